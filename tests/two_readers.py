"""A value read by two ops that may decide apart: ``h`` read by two Dense layers (shared by the
search's relayout-set tests and the XLA:GPU check that such a value is gathered once)."""

import flax.linen as nn


class TwoReaders(nn.Module):
    hidden: int = 64
    out: int = 32

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.hidden, use_bias=False, name="fc")(x))
        a = nn.Dense(self.out, use_bias=False, name="left")(h)
        return a * nn.Dense(self.out, use_bias=False, name="right")(h)
