"""Sandbox runtimes."""
