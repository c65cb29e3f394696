"""The one tap pipeline (intervene, grad, keep, store), the tap-insertion pass, the in-place
engine and the statistics. Imports only ``core``."""
