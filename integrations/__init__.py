"""Integrations with training frameworks (Lightning, plain loops)."""
