"""Helpers shared by the test tiers (no test module imports another)."""
