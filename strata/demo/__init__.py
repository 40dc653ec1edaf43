"""The built-in demo model: a pack directory shipped as package data (see DATA.md)."""
