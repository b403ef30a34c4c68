"""Conversions to every format, their quality, and what each model family supports."""
