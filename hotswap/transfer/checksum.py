"""The trainer-side name of the weight checksum: `tensor_sha256` (hotswap/weights/checksum.py), the digest
`weight_checksums()` reports, for a trainer to compare with what it sent."""

from hotswap.weights.checksum import tensor_sha256

__all__ = ["tensor_sha256"]
