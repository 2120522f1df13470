"""phalanx.engine"""
