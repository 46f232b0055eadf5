"""The engine node: a sans-IO scheduler over a PaddlePaddle model, and its I/O shell."""

import warnings

# PaddlePaddle warns at import that ccache is missing; it only matters to people compiling
# custom operators, and it would greet every `fd serve` user.
warnings.filterwarnings("ignore", message="No ccache found")
