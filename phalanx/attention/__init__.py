"""phalanx.attention"""
