"""Test-suite switches. NANOSERVE_TEST_SPECULATIVE=ngram runs every engine the tests start with
speculative decoding on (unless a test sets speculative_method itself): the check that the whole
suite passes with it, `NANOSERVE_TEST_SPECULATIVE=ngram python -m pytest -q`."""
import os

from nanoserve.config import Config

if method := os.environ.get("NANOSERVE_TEST_SPECULATIVE"):
    _post_init = Config.__post_init__

    def _speculative_post_init(self: Config) -> None:
        if self.speculative_method is None:
            self.speculative_method = method
        _post_init(self)

    Config.__post_init__ = _speculative_post_init
