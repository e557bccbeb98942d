"""Decodes an 8-bit RGB/RGBA/grey PNG with the standard library and prints its width, height,
the standard deviation of its luminance and the share of pixels that are not white.

Usage: python3 scripts/png_spread.py FILE.png
Used by tests/report.rs to check a screenshot is not blank (a PNG crate as a dev-dependency
changed the features of flate2 and made `cargo test` rebuild DataFusion).
"""
import math
import struct
import sys
import zlib


def main(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + n
    w, h, depth, color, _, _, interlace = ihdr
    assert depth == 8 and interlace == 0, "8-bit, non-interlaced only"
    ch = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    raw = zlib.decompress(b"".join(idat))
    stride = w * ch
    prev = bytearray(stride)
    total = sq = 0.0
    ink = 0
    i = 0
    for _ in range(h):
        f = raw[i]
        line = bytearray(raw[i + 1 : i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - ch] if x >= ch else 0
            b = prev[x]
            c = prev[x - ch] if x >= ch else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pr = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[x] = (line[x] + pr) & 255
        for x in range(0, stride, ch):
            lum = line[x] if ch < 3 else 0.299 * line[x] + 0.587 * line[x + 1] + 0.114 * line[x + 2]
            total += lum
            sq += lum * lum
            ink += lum < 250
        prev = line
    n = w * h
    mean = total / n
    print(w, h, math.sqrt(max(sq / n - mean * mean, 0.0)), ink / n)


if __name__ == "__main__":
    main(sys.argv[1])
