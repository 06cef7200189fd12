"""In native mutation runs only (copied as `sitecustomize.py` into the overlay folder that
tests/mutation/native.py puts first on PYTHONPATH): `tbpipe._native` and `tbpipe._native_test` are
imported from the mutated build beside this file, in the test process and in every Python process
it starts, ahead of the installed extensions that the editable install's finder would map them to."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

EXTENSIONS = ("tbpipe._native", "tbpipe._native_test")
HERE = os.path.dirname(os.path.abspath(__file__))


class MutatedExtensionsFirst(importlib.abc.MetaPathFinder):
    """Finds the extensions as `<overlay>/tbpipe/<name><suffix>`; any other module as before."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in EXTENSIONS:
            return None
        name = fullname.rpartition(".")[2]
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = os.path.join(HERE, "tbpipe", name + suffix)
            if os.path.isfile(candidate):
                return importlib.util.spec_from_file_location(fullname, candidate)
        return None


sys.meta_path.insert(0, MutatedExtensionsFirst())


def pytest_configure(config):
    """As the pytest plugin of a mutant's test run (`-p sitecustomize`): a property test's first
    failing example is enough to kill a mutant, so hypothesis does not shrink it (shrinking took
    minutes on a loaded machine). Test modules are imported after this, so their settings inherit it."""
    from hypothesis import Phase, settings

    settings.register_profile("native-mutants", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("native-mutants")
