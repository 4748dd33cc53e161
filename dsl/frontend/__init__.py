"""From text to a checked Program: parser, imports, expressions, configuration, model and layer checks,
the canonical formatter, the profile reader and the installed standard library."""
