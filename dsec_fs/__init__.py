"""dsecfs core: errors, digests, compression, chunk stores, packs, layers and refs.

This package imports nothing else of the project; every other package builds on it.
"""
