"""phalanx.distributed"""
