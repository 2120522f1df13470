"""phalanx.sample"""
