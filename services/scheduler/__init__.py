"""Scheduler: pure policies and the simulator, plus the live round loop around them."""
