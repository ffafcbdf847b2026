"""``external_components.py`` registers components when imported: only the recipe subprocesses of
tests/recipes/test_components.py import it, never pytest's collection (the library's registries of
this process stay the built-ins)."""

collect_ignore = ["external_components.py"]
