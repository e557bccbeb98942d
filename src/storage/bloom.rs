//! A Parquet split-block bloom filter read out of a part, checked by a value's hash.
//!
//! Parquet's own `Sbbf::check` hashes the value on every call. A caller asking many
//! filters about the same values (which judged part a nested reply belongs to: every
//! reply against every part's filter) hashes each value once with [`hash`] and asks
//! [`Bloom::check_hash`], a few instructions per filter. The layout and hash are the
//! Parquet format's (BloomFilter.md): xxHash64 with seed 0, the upper 32 bits choosing a
//! 256-bit block and the lower 32 bits, multiplied by eight salts, one bit per word.

/// One row group's bloom filter on a column: its blocks of eight 32-bit words.
#[derive(Debug, Clone)]
pub struct Bloom {
    blocks: Vec<[u32; 8]>,
}

const SALT: [u32; 8] = [
    0x47b6_137b,
    0x4497_4d91,
    0x8824_ad5b,
    0xa2b7_289d,
    0x7054_95c7,
    0x2df1_424b,
    0x9efc_4947,
    0x5c6b_fb31,
];

impl Bloom {
    /// The filter of Parquet's reader (its bitset, as the format lays it out).
    pub fn from_sbbf(f: &datafusion::parquet::bloom_filter::Sbbf) -> Self {
        let mut bytes = Vec::with_capacity(f.num_blocks() * 32);
        f.write_bitset(&mut bytes)
            .expect("writing a bitset into a Vec does not fail");
        let blocks = bytes
            .chunks_exact(32)
            .map(|b| {
                std::array::from_fn(|i| {
                    u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
                })
            })
            .collect();
        Bloom { blocks }
    }

    /// An empty filter for about `n` values at 16 bits a value (about 0.1% false
    /// positives). Any number of blocks works: the block is chosen by a multiply-shift.
    pub fn for_values(n: usize) -> Self {
        Bloom {
            blocks: vec![[0; 8]; n.div_ceil(16).max(1)],
        }
    }

    /// Adds the value whose [`hash`] this is.
    #[inline]
    pub fn insert_hash(&mut self, h: u64) {
        let i = (((h >> 32) * self.blocks.len() as u64) >> 32) as usize;
        let x = h as u32;
        for (w, salt) in self.blocks[i].iter_mut().zip(SALT) {
            *w |= 1u32 << (x.wrapping_mul(salt) >> 27);
        }
    }

    /// Whether the filter may hold the value whose [`hash`] this is (never a false "no").
    #[inline]
    pub fn check_hash(&self, h: u64) -> bool {
        if self.blocks.is_empty() {
            return true;
        }
        let block = &self.blocks[(((h >> 32) * self.blocks.len() as u64) >> 32) as usize];
        let x = h as u32;
        (0..8).all(|i| block[i] & (1u32 << (x.wrapping_mul(SALT[i]) >> 27)) != 0)
    }

    /// The filter's size in bytes.
    pub fn bytes(&self) -> usize {
        self.blocks.len() * 32
    }
}

/// The hash a Parquet bloom filter files a value under: xxHash64 of its bytes, seed 0.
pub fn hash(v: &[u8]) -> u64 {
    const P1: u64 = 0x9E37_79B1_85EB_CA87;
    const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const P3: u64 = 0x1656_67B1_9E37_79F9;
    const P4: u64 = 0x85EB_CA77_C2B2_AE63;
    const P5: u64 = 0x27D4_EB2F_1656_67C5;
    let round = |acc: u64, x: u64| {
        acc.wrapping_add(x.wrapping_mul(P2))
            .rotate_left(31)
            .wrapping_mul(P1)
    };
    let merge = |h: u64, v: u64| (h ^ round(0, v)).wrapping_mul(P1).wrapping_add(P4);
    let u64_at = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
    let mut rest = v;
    let mut h = if v.len() >= 32 {
        let mut acc = [P1.wrapping_add(P2), P2, 0, 0u64.wrapping_sub(P1)];
        while rest.len() >= 32 {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = round(*a, u64_at(&rest[8 * k..]));
            }
            rest = &rest[32..];
        }
        let mut h = acc[0]
            .rotate_left(1)
            .wrapping_add(acc[1].rotate_left(7))
            .wrapping_add(acc[2].rotate_left(12))
            .wrapping_add(acc[3].rotate_left(18));
        for a in acc {
            h = merge(h, a);
        }
        h
    } else {
        P5
    };
    h = h.wrapping_add(v.len() as u64);
    while rest.len() >= 8 {
        h ^= round(0, u64_at(rest));
        h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
        rest = &rest[8..];
    }
    if rest.len() >= 4 {
        let w = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        h ^= u64::from(w).wrapping_mul(P1);
        h = h.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
        rest = &rest[4..];
    }
    for &b in rest {
        h ^= u64::from(b).wrapping_mul(P5);
        h = h.rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::parquet::bloom_filter::Sbbf;

    /// The hash and the check answer as Parquet's own filter does, for values of every
    /// length around the hash's 4-, 8- and 32-byte steps.
    #[test]
    fn checks_as_parquets_filter_does() {
        assert_eq!(hash(b""), 17_241_709_254_077_376_921);
        let mut sbbf = Sbbf::new_with_ndv_fpp(500, 0.01).unwrap();
        let value = |i: usize| format!("{i:x}").repeat(1 + i % 23);
        for i in (0..2000).step_by(4) {
            sbbf.insert(value(i).as_str());
        }
        let ours = Bloom::from_sbbf(&sbbf);
        assert_eq!(ours.bytes(), sbbf.num_blocks() * 32);
        let (mut yes, mut no) = (0, 0);
        for i in 0..2000 {
            let v = value(i);
            let want = sbbf.check(v.as_str());
            assert_eq!(ours.check_hash(hash(v.as_bytes())), want, "{v}");
            if i % 4 == 0 {
                assert!(want, "{v} was inserted");
            }
            if want { yes += 1 } else { no += 1 }
        }
        assert!(yes >= 500 && no > 1000, "{yes} maybe, {no} no");
    }

    /// A filter built here holds every value inserted, and at 16 bits a value answers
    /// "maybe" for about 0.1% of the others (Parquet's split-block filter at that size:
    /// 0.05% to 0.2%); an odd number of blocks works as well as a power of two.
    #[test]
    fn built_filters_hold_their_values_at_about_a_tenth_of_a_percent() {
        for n in [1usize, 100, 4096, 5000] {
            let mut f = Bloom::for_values(n);
            for i in 0..n {
                f.insert_hash(hash(format!("in-{i}").as_bytes()));
            }
            for i in 0..n {
                assert!(
                    f.check_hash(hash(format!("in-{i}").as_bytes())),
                    "{n}: in-{i}"
                );
            }
            let probes = 200_000;
            let fp = (0..probes)
                .filter(|i| f.check_hash(hash(format!("out-{i}").as_bytes())))
                .count();
            let rate = fp as f64 / probes as f64;
            if n >= 100 {
                assert!(rate > 0.0001 && rate < 0.003, "{n} values: {rate}");
            }
        }
    }
}
