//! The file cut into blocks of whole lines: windows mapped into memory, or buffers read
//! from a pipe, each with the number of its first line.

/// Bytes the reader thread takes from the file at a time (whole lines; a longer line makes
/// a longer block): big enough that a parse of a block keeps every core busy, small enough
/// that memory holds a few blocks, never the file.
pub(super) const BLOCK_BYTES: usize = 4 << 20;

/// Whole lines of the file, with the number of the first.
pub(super) struct Block {
    pub(super) first_line: usize,
    pub(super) data: Bytes,
    /// The block's lines are `data[..len]` (a mapped window ends inside the next line).
    pub(super) len: usize,
    /// How many lines it holds.
    pub(super) lines: usize,
}

impl Block {
    pub(super) fn lines(&self) -> &[u8] {
        &self.data[..self.len]
    }
}

/// A block's bytes: a window of the file mapped into memory, so the parse reads the page
/// cache where it is rather than a copy that `read` made of it; or, where the file cannot
/// be mapped (a pipe, a special file), bytes read into a buffer.
pub(super) enum Bytes {
    Mapped(memmap2::Mmap),
    Read(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Read(v) => v,
        }
    }
}

/// A block's lines with their numbers, as `BufRead::lines` gives them (without `\n` or
/// `\r\n`; a last line without newline is a line).
pub(super) fn split_lines(block: &Block) -> Vec<(usize, &[u8])> {
    let data = block.lines();
    let mut out = Vec::with_capacity(data.len() / 256);
    let mut start = 0;
    let mut push = |start: usize, end: usize| {
        let l = &data[start..end];
        out.push((
            block.first_line + out.len(),
            l.strip_suffix(b"\r").unwrap_or(l),
        ));
    };
    for end in memchr::memchr_iter(b'\n', data) {
        push(start, end);
        start = end + 1;
    }
    if start < data.len() {
        push(start, data.len());
    }
    out
}

/// Sends a regular file as [`Block`]s of about [`BLOCK_BYTES`] of whole lines, each a
/// window of the file mapped into memory and unmapped once its lines are parsed, so the
/// resident memory is the blocks in flight, never the file. A window with no newline (a line
/// longer than a block) is mapped again twice as large.
///
/// A file truncated while it is mapped kills the process (SIGBUS) instead of yielding half a
/// line: import writes under `_import/` until it finishes, so no table is left half-written.
pub(super) fn map_blocks(
    f: &std::fs::File,
    size: u64,
    tx: &std::sync::mpsc::SyncSender<std::io::Result<Block>>,
) {
    let (mut start, mut first_line, mut window) = (0u64, 1, BLOCK_BYTES as u64);
    while start < size {
        let len = window.min(size - start);
        // SAFETY: the map is read only; the file is one evalflow opened to import and does
        // not write (see above for a file that another process truncates).
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(start)
                .len(len as usize)
                .map(f)
        };
        let map = match map {
            Ok(m) => m,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        // A file not in the page cache: read the whole window ahead, not page by page as the
        // line count below touches it. Only a hint; a refusal changes nothing.
        let _ = map.advise(memmap2::Advice::WillNeed);
        let end = if start + len == size {
            len as usize
        } else {
            // Cut after the last newline; the partial line starts the next block.
            match memchr::memrchr(b'\n', &map) {
                Some(e) => e + 1,
                None => {
                    window *= 2;
                    continue;
                }
            }
        };
        let lines = memchr::memchr_iter(b'\n', &map[..end]).count();
        let block = Block {
            first_line,
            data: Bytes::Mapped(map),
            len: end,
            lines,
        };
        if tx.send(Ok(block)).is_err() {
            return;
        }
        (start, first_line, window) = (start + end as u64, first_line + lines, BLOCK_BYTES as u64);
    }
}

/// Sends the file as [`Block`]s of about [`BLOCK_BYTES`] of whole lines read into buffers
/// (the last line may lack its newline), until the end, a read error, or a receiver that
/// hung up: for a file that cannot be mapped.
pub(super) fn read_blocks(
    mut f: std::fs::File,
    tx: &std::sync::mpsc::SyncSender<std::io::Result<Block>>,
) {
    use std::io::Read;
    let mut carry: Vec<u8> = Vec::new();
    let mut first_line = 1;
    loop {
        // Bounded: at most BLOCK_BYTES more than the partial line carried over. Only a line
        // longer than a block grows the buffer past that, until its newline, as
        // `BufRead::lines` would also hold it whole: a record is one line.
        let mut data = std::mem::take(&mut carry);
        data.reserve(BLOCK_BYTES);
        let read = (&mut f).take(BLOCK_BYTES as u64).read_to_end(&mut data);
        match read {
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
            Ok(0) => {
                if !data.is_empty() {
                    // The last line, without its newline.
                    let len = data.len();
                    let data = Bytes::Read(data);
                    let _ = tx.send(Ok(Block {
                        first_line,
                        data,
                        len,
                        lines: 1,
                    }));
                }
                return;
            }
            Ok(_) => {}
        }
        // Cut after the last newline; the partial line starts the next block.
        let Some(end) = memchr::memrchr(b'\n', &data) else {
            carry = data;
            continue;
        };
        carry = data[end + 1..].to_vec();
        data.truncate(end + 1);
        let lines = memchr::memchr_iter(b'\n', &data).count();
        let len = data.len();
        let data = Bytes::Read(data);
        if tx
            .send(Ok(Block {
                first_line,
                data,
                len,
                lines,
            }))
            .is_err()
        {
            return;
        }
        first_line += lines;
    }
}
