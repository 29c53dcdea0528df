"""Preparation: a request envelope turned into the engine's request (templating,
tokenizing, tools, grammars, media), off the engine thread."""
