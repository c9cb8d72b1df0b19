"""The examples, a package so that the tools and the migration pair import ``examples.train_gpt``; each
script's docstring gives its launch command, run from the repository root."""
