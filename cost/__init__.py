"""cost package."""
