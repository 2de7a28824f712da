"""Zero the PTX payloads for archs newer than one GPU arch inside a shared library's fatbins.

The companion of ../shared/gpu/fatbin_keep_arch.py, which zeroes foreign cubins but keeps all
PTX: PTX for sm_100 or sm_120 cannot be JIT-compiled for an sm_90 GPU, so on an H100 it is dead
weight (30 MB of NCCL 2.30.7's). PTX for the kept arch and older stays. The file keeps its size
and layout.
usage: python3 fatbin_drop_ptx.py LIB.so 90   (in place)
"""
import struct
import sys
from pathlib import Path

MAGIC = 0xBA55ED50
PTX = 1


def main(path, keep):
    data = bytearray(Path(path).read_bytes())
    pos, zeroed, zbytes = 0, 0, 0
    while True:
        pos = data.find(struct.pack("<I", MAGIC), pos)
        if pos < 0:
            break
        _, ver, hsize, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if ver != 1 or hsize != 16 or fat_size <= 0 or pos + 16 + fat_size > len(data):
            pos += 4
            continue
        e = pos + hsize
        end = pos + hsize + fat_size
        while e < end:
            kind, _, ehsize, padded = struct.unpack_from("<HHIQ", data, e)
            sm = struct.unpack_from("<I", data, e + 28)[0]
            if ehsize == 0:
                break
            payload = e + ehsize
            if kind == PTX and sm > keep:
                data[payload:payload + padded] = bytes(padded)
                zeroed += 1
                zbytes += padded
            e = payload + padded
        pos = end
    if zeroed:
        Path(path).write_bytes(data)
    print(f"{path}: zeroed {zeroed} PTX entries newer than sm_{keep} ({zbytes / 1e6:.1f} MB)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
