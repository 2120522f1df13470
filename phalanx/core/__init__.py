"""phalanx.core"""
