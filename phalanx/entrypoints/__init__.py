"""phalanx.entrypoints"""
