"""The fault catalogue: every catalogued bug as a small, named variant of correct code."""
