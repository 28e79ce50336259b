"""Thin adapters between wire protocols and the session core and engine."""
