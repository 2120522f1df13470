"""phalanx.spec_decode"""
