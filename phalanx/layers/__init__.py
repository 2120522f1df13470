"""phalanx.layers"""
