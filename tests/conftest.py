import os
import tempfile

# Generated checkpoints (strata-tiny) go to a per-run home unless the caller chose one, so tests never
# depend on, or write to, the user's cache.
os.environ.setdefault("STRATA_HOME", os.path.join(tempfile.gettempdir(), f"strata-test-home-{os.getuid()}"))

import torch  # noqa: E402

# Tests run many tiny ops: on 2 cores one intra-op thread is faster and leaves a core to Ray and helpers.
torch.set_num_threads(1)
