# The notebooks here attack whatever runs them: only `attnlab grade` may (tests/test_grading_hostile.py).
collect_ignore_glob = ["*.ipynb", "*/*.ipynb", "*/*/*.ipynb"]
