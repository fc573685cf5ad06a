"""Explanations: bug classes as plug-ins that read a case's key map and facts (see :mod:`.evidence`)."""
