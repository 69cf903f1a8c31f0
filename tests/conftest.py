import os
import tempfile

# Generated checkpoints (strata-tiny) and the file L3 store of the default config go to the tests' own
# home (STRATA_TEST_HOME chooses it), never to STRATA_HOME: a user's `make run` may be serving from that
# one while the suite runs, and the reliability tests corrupt L3 pages on purpose.
os.environ["STRATA_HOME"] = os.environ.get("STRATA_TEST_HOME") or os.path.join(
    tempfile.gettempdir(), f"strata-test-home-{os.getuid()}")

import torch  # noqa: E402

# strata's kernels/ is a namespace package that Hugging Face's `kernels` (transformers' dependency) may own:
# its modules resolve once storage.kernels_path has put kernels/ on the package's path (see there).
import storage.kernels_path  # noqa: E402,F401

# Tests run many tiny ops: on 2 cores one intra-op thread is faster and leaves a core to Ray and helpers.
torch.set_num_threads(1)
