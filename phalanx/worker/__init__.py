"""phalanx.worker"""
