"""phalanx.models"""
