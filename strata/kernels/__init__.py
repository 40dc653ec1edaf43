"""Built GPU kernels: one <op>.fatbin per cuda/<op>.cu and manifest.json (written by the build, never committed)."""
