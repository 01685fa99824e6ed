"""EROFS on-disk structures, one module each: a struct.Struct, pack/unpack/validate, a comment per field.

All integers are little-endian. We write "old-style" images (no 48BIT, METABOX or NLINK_1 bits) so any
kernel since 5.16 mounts them; see docs/format.md for the byte tables of what we write.
"""

BLKSZBITS = 12
BLOCK_SIZE = 1 << BLKSZBITS
EROFS_NULL_ADDR = 0xFFFFFFFF  # a chunk or data address meaning "no data": reads as zeros
ISLOTBITS = 5  # inodes sit on 32-byte slots: offset = meta_blkaddr * blksz + nid * 32
INODE_SLOT_SIZE = 1 << ISLOTBITS
