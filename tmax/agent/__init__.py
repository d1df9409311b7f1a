"""The mini-swe-agent-style harness: one bash tool in a persistent shell, driven by a policy."""
