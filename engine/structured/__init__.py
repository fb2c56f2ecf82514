"""Structured output: constraints compiled by llguidance (in a sandbox first), masks, the JSON closer."""
