//! The part of the zip format an Inspect `.eval` log needs: the central directory, and one
//! entry's compressed bytes at a time.
//!
//! # Behavior
//! - Reads the end-of-central-directory record (and its zip64 form, for logs of more than
//!   65,535 samples or 4 GiB), then the central directory: names, compression methods,
//!   compressed sizes and offsets. Nothing else of the archive is held.
//! - [`Archive::open_entry`] returns a reader over one entry, inflated by the codec the entry
//!   names: stored (0), deflate (8, older Inspect) or zstd (93, Inspect today), with flate2
//!   and zstd, which the Parquet reader already builds.
//! - Why not the `zip` crate: even with no default features it changed the features of
//!   dependencies shared with DataFusion, and a build after adding it rebuilt DataFusion
//!   (tens of minutes on 2 cores); this reader is ~150 lines and adds no dependency.
//!
//! # Errors
//! A file with no end-of-central-directory record, a truncated directory or an unknown
//! compression method is an error naming what is wrong.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};

/// One entry of the central directory.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub method: u16,
    pub compressed_size: u64,
    /// As the directory records it (a hint for the output buffer; not trusted).
    pub uncompressed_size: u64,
    local_offset: u64,
}

/// An open archive: the file and its directory.
pub struct Archive {
    file: File,
    pub entries: Vec<Entry>,
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

fn read_at(f: &mut File, at: u64, len: usize) -> std::io::Result<Vec<u8>> {
    f.seek(SeekFrom::Start(at))?;
    let mut b = vec![0u8; len];
    f.read_exact(&mut b)?;
    Ok(b)
}

impl Archive {
    /// Reads the central directory of `file`.
    ///
    /// # Errors
    /// Not a zip, or a truncated one.
    pub fn open(mut file: File) -> Result<Archive, String> {
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        // The end record is the last 22 bytes plus a comment of at most 65,535 bytes.
        let tail_len = len.min(22 + 65_535) as usize;
        let tail =
            read_at(&mut file, len - tail_len as u64, tail_len).map_err(|e| e.to_string())?;
        let eocd = (0..tail_len.saturating_sub(21))
            .rev()
            .find(|&i| u32_at(&tail, i) == 0x0605_4b50)
            .ok_or("no end of central directory: not a zip")?;
        let mut count = u16_at(&tail, eocd + 10) as u64;
        let mut cd_size = u32_at(&tail, eocd + 12) as u64;
        let mut cd_offset = u32_at(&tail, eocd + 16) as u64;
        // A zip64 locator sits right before the end record.
        if eocd >= 20 && u32_at(&tail, eocd - 20) == 0x0706_4b50 {
            let at = u64_at(&tail, eocd - 20 + 8);
            let z = read_at(&mut file, at, 56).map_err(|e| format!("zip64 end record: {e}"))?;
            if u32_at(&z, 0) != 0x0606_4b50 {
                return Err("zip64 end record: bad signature".into());
            }
            count = u64_at(&z, 32);
            cd_size = u64_at(&z, 40);
            cd_offset = u64_at(&z, 48);
        }
        if cd_offset.checked_add(cd_size).is_none_or(|end| end > len) {
            return Err("central directory: past the end of the file (truncated?)".into());
        }
        let cd = read_at(&mut file, cd_offset, cd_size as usize)
            .map_err(|e| format!("central directory: {e}"))?;
        let mut entries = Vec::with_capacity(count.min(1 << 20) as usize);
        let mut i = 0usize;
        for k in 0..count {
            if i + 46 > cd.len() || u32_at(&cd, i) != 0x0201_4b50 {
                return Err(format!("central directory: entry {k} is damaged"));
            }
            let method = u16_at(&cd, i + 10);
            let mut compressed = u32_at(&cd, i + 20) as u64;
            let uncompressed = u32_at(&cd, i + 24);
            let mut uncompressed_size = uncompressed as u64;
            let (n, m, c) = (
                u16_at(&cd, i + 28) as usize,
                u16_at(&cd, i + 30) as usize,
                u16_at(&cd, i + 32) as usize,
            );
            let mut offset = u32_at(&cd, i + 42) as u64;
            if i + 46 + n + m > cd.len() {
                return Err(format!("central directory: entry {k} is damaged"));
            }
            let name = String::from_utf8_lossy(&cd[i + 46..i + 46 + n]).into_owned();
            // Zip64 extra field: the 8-byte values of the fields saturated above, in order.
            let extra = &cd[i + 46 + n..i + 46 + n + m];
            let mut j = 0;
            while j + 4 <= extra.len() {
                let (id, size) = (u16_at(extra, j), u16_at(extra, j + 2) as usize);
                let body = &extra[j + 4..(j + 4 + size).min(extra.len())];
                if id == 1 {
                    let mut p = 0;
                    let mut next = || {
                        let v = (p + 8 <= body.len()).then(|| u64_at(body, p));
                        p += 8;
                        v
                    };
                    if uncompressed == u32::MAX {
                        uncompressed_size = next().unwrap_or(uncompressed_size);
                    }
                    if compressed == u32::MAX as u64 {
                        compressed = next().unwrap_or(compressed);
                    }
                    if offset == u32::MAX as u64 {
                        offset = next().unwrap_or(offset);
                    }
                }
                j += 4 + size;
            }
            entries.push(Entry {
                name,
                method,
                compressed_size: compressed,
                uncompressed_size,
                local_offset: offset,
            });
            i += 46 + n + m + c;
        }
        Ok(Archive { file, entries })
    }

    /// Entry `k`'s uncompressed bytes, read with positional reads (no seek), so that many
    /// threads can read entries of one archive at once; `zstd` is the calling thread's
    /// decompressor, reused from entry to entry (creating one per entry cost 13% of an
    /// import).
    ///
    /// # Errors
    /// As [`Archive::open_entry`].
    pub fn entry_bytes(
        &self,
        k: usize,
        zstd: &mut Option<zstd::bulk::Decompressor<'static>>,
    ) -> Result<Vec<u8>, String> {
        use std::os::unix::fs::FileExt;
        let e = &self.entries[k];
        let mut h = [0u8; 30];
        self.file
            .read_exact_at(&mut h, e.local_offset)
            .map_err(|x| x.to_string())?;
        if u32_at(&h, 0) != 0x0403_4b50 {
            return Err("local header: bad signature".into());
        }
        let start = e.local_offset + 30 + u16_at(&h, 26) as u64 + u16_at(&h, 28) as u64;
        let mut raw = vec![0u8; e.compressed_size as usize];
        self.file
            .read_exact_at(&mut raw, start)
            .map_err(|x| x.to_string())?;
        match e.method {
            0 => Ok(raw),
            // One entry whole: an Inspect entry is one sample (or the header), which the
            // parser needs whole anyway; a reader holds EVAL_CHUNK of them per chunk.
            8 => {
                let mut out = Vec::with_capacity(e.uncompressed_size.min(1 << 30) as usize);
                flate2::read::DeflateDecoder::new(&raw[..])
                    .read_to_end(&mut out)
                    .map_err(|x| format!("deflate: {x}"))?;
                Ok(out)
            }
            93 => {
                if zstd.is_none() {
                    *zstd =
                        Some(zstd::bulk::Decompressor::new().map_err(|x| format!("zstd: {x}"))?);
                }
                let d = zstd.as_mut().expect("set above");
                // The frame's own content size when it has one, else the directory's.
                let cap = zstd::zstd_safe::get_frame_content_size(&raw)
                    .ok()
                    .flatten()
                    .unwrap_or(e.uncompressed_size)
                    .max(e.uncompressed_size) as usize;
                d.decompress(&raw, cap).map_err(|x| format!("zstd: {x}"))
            }
            m => Err(format!(
                "compression method {m} is not stored, deflate or zstd"
            )),
        }
    }

    /// A reader of entry `k`'s uncompressed bytes.
    ///
    /// # Errors
    /// A damaged local header or a compression method other than stored, deflate or zstd.
    pub fn open_entry(&mut self, k: usize) -> Result<Box<dyn Read + '_>, String> {
        let e = self.entries[k].clone();
        let h = read_at(&mut self.file, e.local_offset, 30).map_err(|x| x.to_string())?;
        if u32_at(&h, 0) != 0x0403_4b50 {
            return Err("local header: bad signature".into());
        }
        let start = e.local_offset + 30 + u16_at(&h, 26) as u64 + u16_at(&h, 28) as u64;
        self.file
            .seek(SeekFrom::Start(start))
            .map_err(|x| x.to_string())?;
        let raw = BufReader::new((&mut self.file).take(e.compressed_size));
        Ok(match e.method {
            0 => Box::new(raw),
            8 => Box::new(flate2::bufread::DeflateDecoder::new(raw)),
            93 => Box::new(
                zstd::stream::read::Decoder::with_buffer(raw).map_err(|x| format!("zstd: {x}"))?,
            ),
            m => {
                return Err(format!(
                    "compression method {m} is not stored, deflate or zstd"
                ));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stored entry in a zip written by hand: the directory and the bytes round-trip.
    #[test]
    fn reads_a_stored_entry() {
        let data = b"{\"a\": 1}";
        let name = b"samples/x.json";
        let mut z = Vec::new();
        let crc = 0u32; // not checked by this reader
        z.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        z.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        z.extend_from_slice(&crc.to_le_bytes());
        z.extend_from_slice(&(data.len() as u32).to_le_bytes());
        z.extend_from_slice(&(data.len() as u32).to_le_bytes());
        z.extend_from_slice(&(name.len() as u16).to_le_bytes());
        z.extend_from_slice(&0u16.to_le_bytes());
        z.extend_from_slice(name);
        z.extend_from_slice(data);
        let cd_at = z.len() as u32;
        z.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        z.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        z.extend_from_slice(&crc.to_le_bytes());
        z.extend_from_slice(&(data.len() as u32).to_le_bytes());
        z.extend_from_slice(&(data.len() as u32).to_le_bytes());
        z.extend_from_slice(&(name.len() as u16).to_le_bytes());
        z.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        z.extend_from_slice(&0u32.to_le_bytes());
        z.extend_from_slice(name);
        let cd_size = z.len() as u32 - cd_at;
        z.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        z.extend_from_slice(&[0, 0, 0, 0, 1, 0, 1, 0]);
        z.extend_from_slice(&cd_size.to_le_bytes());
        z.extend_from_slice(&cd_at.to_le_bytes());
        z.extend_from_slice(&0u16.to_le_bytes());
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.zip");
        std::fs::write(&p, &z).unwrap();
        let mut a = Archive::open(File::open(&p).unwrap()).unwrap();
        assert_eq!(a.entries.len(), 1);
        assert_eq!(a.entries[0].name, "samples/x.json");
        let mut s = String::new();
        a.open_entry(0).unwrap().read_to_string(&mut s).unwrap();
        assert_eq!(s, "{\"a\": 1}");
        // Truncated: no end record.
        std::fs::write(&p, &z[..z.len() - 10]).unwrap();
        assert!(Archive::open(File::open(&p).unwrap()).is_err());
    }
}
