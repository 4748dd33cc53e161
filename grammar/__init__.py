"""Holds dhelix.lark, the grammar of the language (package data)."""
