"""Linear layers: weight-only quantization and the oneDNN linear."""
