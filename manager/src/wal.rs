//! The write-ahead log in front of the store: each group of changes is
//! appended and made durable with one `fdatasync` of a pre-written file
//! (no metadata changes, so the flush is a single device write), then
//! applied to redb without waiting. A checkpoint makes redb durable and
//! starts the log over under a new epoch.
//!
//! Entry: `len u32 | crc32 u32 | epoch u64 | payload` (little endian),
//! where the crc covers epoch and payload. Replay reads entries from the
//! start while they are whole, match their crc and carry the current epoch;
//! the first that does not ends the log (a torn tail, or an older epoch).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Default bytes of the log file, written with zeros once when created (so
/// that appends never need new blocks: the log keeps working on a full disk).
pub const WAL_SIZE: u64 = 16 << 20;
/// The smallest log the manager accepts (`--wal-size`).
pub const MIN_WAL_SIZE: u64 = 64 << 10;
const ENTRY_HEADER: usize = 16;

/// The log.
pub struct Wal {
    file: File,
    /// Bytes of the file.
    size: u64,
    epoch: u64,
    /// Where the next entry goes.
    end: u64,
}

impl Wal {
    /// Opens (creating and pre-writing if needed) the log at `path`, of
    /// [`WAL_SIZE`] bytes.
    pub fn open(path: &Path) -> std::io::Result<Wal> {
        Wal::open_sized(path, WAL_SIZE)
    }

    /// [`Wal::open`] with a log of `size` bytes (at least [`MIN_WAL_SIZE`];
    /// an existing larger file keeps its size).
    pub fn open_sized(path: &Path, size: u64) -> std::io::Result<Wal> {
        let size = size.max(MIN_WAL_SIZE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let len = file.metadata()?.len();
        let size = size.max(len);
        if len < size {
            // Write real zeros (not a hole or fallocate's unwritten extents)
            // so later overwrites change no file metadata.
            file.seek(SeekFrom::Start(len))?;
            let zeros = vec![0u8; 1 << 20];
            let mut left = size - len;
            while left > 0 {
                let n = left.min(zeros.len() as u64) as usize;
                file.write_all(&zeros[..n])?;
                left -= n as u64;
            }
            file.sync_all()?;
        }
        Ok(Wal {
            file,
            size,
            epoch: 0,
            end: 0,
        })
    }

    /// Reads the entries of `epoch` from the start; afterwards appends
    /// continue after the last one.
    pub fn replay(&mut self, epoch: u64) -> std::io::Result<Vec<Vec<u8>>> {
        let mut data = Vec::new();
        self.file.seek(SeekFrom::Start(0))?;
        (&self.file).take(self.size).read_to_end(&mut data)?;
        let mut entries = Vec::new();
        let mut at = 0usize;
        while at + ENTRY_HEADER <= data.len() {
            let len = u32::from_le_bytes(data[at..at + 4].try_into().unwrap_or_default()) as usize;
            let crc = u32::from_le_bytes(data[at + 4..at + 8].try_into().unwrap_or_default());
            let end = at + ENTRY_HEADER + len;
            if len == 0 || end > data.len() {
                break;
            }
            let body = &data[at + 8..end];
            let entry_epoch = u64::from_le_bytes(body[..8].try_into().unwrap_or_default());
            if crc32fast::hash(body) != crc || entry_epoch != epoch {
                break;
            }
            entries.push(body[8..].to_vec());
            at = end;
        }
        self.epoch = epoch;
        self.end = at as u64;
        Ok(entries)
    }

    /// Whether an entry of `len` payload bytes fits after the current end.
    pub fn fits(&self, len: usize) -> bool {
        self.end + (ENTRY_HEADER + len) as u64 <= self.size
    }

    /// Bytes of the log file.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes used by entries of the current epoch.
    pub fn used(&self) -> u64 {
        self.end
    }

    /// Appends one entry and waits until it is durable.
    pub fn append(&mut self, payload: &[u8]) -> std::io::Result<()> {
        if !self.fits(payload.len()) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "write-ahead log entry does not fit",
            ));
        }
        let mut entry = Vec::with_capacity(ENTRY_HEADER + payload.len());
        entry.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        entry.extend_from_slice(&[0u8; 4]);
        entry.extend_from_slice(&self.epoch.to_le_bytes());
        entry.extend_from_slice(payload);
        let crc = crc32fast::hash(&entry[8..]);
        entry[4..8].copy_from_slice(&crc.to_le_bytes());
        self.file.write_all_at(&entry, self.end)?;
        self.file.sync_data()?;
        self.end += entry.len() as u64;
        Ok(())
    }

    /// Starts the log over under `epoch` (after a checkpoint recorded it).
    pub fn restart(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.end = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_replay_in_order_until_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wal");
        let mut wal = Wal::open(&path).unwrap();
        assert!(wal.replay(1).unwrap().is_empty());
        wal.append(b"one").unwrap();
        wal.append(b"two").unwrap();
        wal.append(b"three").unwrap();
        let torn_at = wal.used() - 2;
        drop(wal);
        let mut wal = Wal::open(&path).unwrap();
        assert_eq!(
            wal.replay(1).unwrap(),
            vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]
        );
        // Corrupt the last entry: replay stops before it.
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(b"XX", torn_at).unwrap();
        let mut wal = Wal::open(&path).unwrap();
        assert_eq!(
            wal.replay(1).unwrap(),
            vec![b"one".to_vec(), b"two".to_vec()]
        );
        // Appends continue after the last whole entry.
        wal.append(b"four").unwrap();
        let mut again = Wal::open(&path).unwrap();
        assert_eq!(again.replay(1).unwrap().last().unwrap(), b"four");
    }

    #[test]
    fn a_new_epoch_hides_older_entries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wal");
        let mut wal = Wal::open(&path).unwrap();
        wal.replay(1).unwrap();
        for i in 0..10u8 {
            wal.append(&[i; 100]).unwrap();
        }
        wal.restart(2);
        wal.append(b"new").unwrap();
        let mut again = Wal::open(&path).unwrap();
        assert_eq!(again.replay(2).unwrap(), vec![b"new".to_vec()]);
        let mut old = Wal::open(&path).unwrap();
        assert!(
            old.replay(1).unwrap().is_empty(),
            "entry 0 now belongs to epoch 2"
        );
        assert_eq!(std::fs::metadata(&path).unwrap().len(), WAL_SIZE);
    }

    #[test]
    fn oversized_entries_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut wal = Wal::open(&dir.path().join("wal")).unwrap();
        wal.replay(1).unwrap();
        assert!(!wal.fits(WAL_SIZE as usize));
        assert!(wal.append(&vec![0u8; WAL_SIZE as usize]).is_err());
    }
}
