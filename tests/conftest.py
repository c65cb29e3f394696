import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# Tiny models run fastest on one thread, and a shared 2-core machine stays responsive.
torch.set_num_threads(1)
