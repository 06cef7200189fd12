"""In mutation runs only (copied into `mutants/`, which the redirect puts on the PYTHONPATH of the
processes the tests start): child Pythons import the mutated modules too, and while mutmut learns
which tests reach which functions, tell it what they reached."""

import os

import tbpipe_mutation_redirect

if os.environ.get("MUTANT_UNDER_TEST") == "stats":
    tbpipe_mutation_redirect.record_hits_at_exit()
