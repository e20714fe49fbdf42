"""Outside the chapter: the bundled default model."""
