//! One writer per root: the lease a writing verb holds on its run root while it writes.
//!
//! Two processes writing one root (an overlapping cron job, a notebook cell re-run while the
//! command line still works) each sent every call and each committed every row: the journal
//! and the manifest guard a killed writer, not a concurrent one. So every verb that writes
//! (`run`, the stage verbs, `import`, `rescore`, `scorers --delete`, `compact`) first takes
//! the root's lease, `_lease.json`, naming its holder; a second writer exits 2 naming it, or
//! waits for it with `--wait-lock`. Readers never take it: every commit is an atomic rename
//! or put followed by an atomic manifest swap, so they see the last committed state.
//!
//! - **Local roots**: an advisory `flock` on `_lease.json` (`File::try_lock`). The kernel
//!   drops it when its holder exits however it exits (SIGKILL, a panic, a reboot), so a dead
//!   holder never blocks anyone; the file's text names the live holder for the message. The
//!   holder deletes the file before it unlocks, so a root is left as it was; a contender
//!   that locked a file someone deleted meanwhile sees that the path no longer names the file
//!   it locked, and tries again (the classic lock-file protocol: two processes never hold
//!   two files).
//! - **Object stores** (`s3://`, `memory://`): a conditional put (`PutMode::Create`, S3's
//!   `If-None-Match: *`) creates the lease object with an expiry that a background task
//!   renews every third of its time to live with a conditional update (`If-Match` on its
//!   ETag). A lease is taken over (again conditionally, so two contenders cannot both win)
//!   once it expired, or at once when its holder was a process of this host that is gone.
//!   Released by deleting it.

use std::collections::HashSet;
use std::io::{Read, Seek, Write};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};
use serde::{Deserialize, Serialize};

use super::{RunStore, StorageError};

/// The lease object under the root.
pub const LEASE_FILE: &str = "_lease.json";

/// `--wait-lock`: a writer waits for the root's lease instead of exiting 2.
static WAIT: AtomicBool = AtomicBool::new(false);

/// Leases this process holds on object stores (by lease location): a lease object naming
/// this process but not in here was left by an earlier command of this process (the Python
/// package runs many), so it is stale.
static HELD: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// The verb this process runs, named in its lease (set by the CLI before it dispatches).
static VERB: Mutex<&'static str> = Mutex::new("?");

/// Names the verb that takes leases from now on.
pub fn set_verb(verb: &'static str) {
    if let Ok(mut v) = VERB.lock() {
        *v = verb;
    }
}

/// The verb set by [`set_verb`].
pub fn verb() -> &'static str {
    VERB.lock().map(|v| *v).unwrap_or("?")
}

/// Makes [`Lease::acquire`] wait for a held lease instead of failing (`--wait-lock`).
pub fn set_wait(wait: bool) {
    WAIT.store(wait, Ordering::Relaxed);
}

/// How long an object-store lease lives without renewal: `EVALFLOW_LEASE_TTL_SECS`, default
/// 60 s. A holder on another host that died blocks the root this long at most.
fn ttl() -> Duration {
    let secs = crate::config::env_count("EVALFLOW_LEASE_TTL_SECS").unwrap_or(60);
    Duration::from_secs(secs)
}

/// Who holds a lease: what `_lease.json` says.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Holder {
    /// The verb that writes (`call`, `import`, ...).
    pub verb: String,
    pub host: String,
    pub pid: u32,
    /// The process's start time in clock ticks since boot (Linux `/proc/PID/stat` field 22),
    /// so that a reused pid is not taken for the holder.
    #[serde(default)]
    pub proc_start: Option<u64>,
    /// When the lease was taken (RFC 3339, UTC).
    pub acquired: String,
    /// Object stores: when the lease lapses unless renewed (RFC 3339, UTC).
    #[serde(default)]
    pub expires: Option<String>,
    /// Unique per acquisition: tells our own lease from a successor's.
    pub token: String,
}

impl Holder {
    fn ours(verb: &str, expires: Option<Duration>) -> Holder {
        let now = chrono::Utc::now();
        Holder {
            verb: verb.to_string(),
            host: hostname(),
            pid: std::process::id(),
            proc_start: proc_start(std::process::id()),
            acquired: now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            expires: expires.map(|d| {
                (now + chrono::Duration::from_std(d).unwrap_or_default())
                    .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
            }),
            token: uuid::Uuid::new_v4().to_string(),
        }
    }

    /// A sentence naming the holder, for the refusal.
    pub fn describe(&self) -> String {
        format!(
            "`evalflow {}` (pid {} on {}, since {})",
            self.verb, self.pid, self.host, self.acquired
        )
    }

    /// Whether the holder can no longer be writing: its lease expired, or it was a process of
    /// this host that is gone (or an earlier command of this process that did not release).
    fn is_stale(&self, location: &str) -> bool {
        if let Some(exp) = &self.expires
            && let Ok(t) = chrono::DateTime::parse_from_rfc3339(exp)
            && t < chrono::Utc::now()
        {
            return true;
        }
        if self.host != hostname() {
            return false;
        }
        if self.pid == std::process::id() {
            return !held().contains(location);
        }
        !process_alive(self.pid, self.proc_start)
    }
}

fn held() -> HashSet<String> {
    HELD.lock().ok().and_then(|h| h.clone()).unwrap_or_default()
}

fn set_held(location: &str, on: bool) {
    if let Ok(mut h) = HELD.lock() {
        let set = h.get_or_insert_with(HashSet::new);
        if on {
            set.insert(location.to_string());
        } else {
            set.remove(location);
        }
    }
}

/// This machine's name (Linux's kernel hostname, else `HOSTNAME`, else `localhost`).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// The start time of `pid` in clock ticks since boot, where `/proc` has it and the process
/// still runs (a zombie, exited but not yet reaped by its parent, counts as gone).
fn proc_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    if matches!(fields.next(), Some("Z" | "X" | "x")) {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Whether `pid` still runs as the process that took the lease. Without `/proc` a process is
/// taken to be alive (the lease then lapses by its expiry).
fn process_alive(pid: u32, start: Option<u64>) -> bool {
    if !std::path::Path::new("/proc/self").exists() {
        return true;
    }
    match proc_start(pid) {
        None => false,
        Some(now) => start.is_none_or(|s| s == now),
    }
}

/// Object-store leases dropped but not yet deleted: a drop cannot wait for the store, so
/// [`release_dropped`] (the CLI calls it when a command ends) deletes them.
static DROPPED: Mutex<Vec<(RunStore, String)>> = Mutex::new(Vec::new());

/// Deletes the lease objects of leases dropped in this process (each only while it still
/// names its holder).
pub async fn release_dropped() {
    let dropped = DROPPED
        .lock()
        .map(|mut d| std::mem::take(&mut *d))
        .unwrap_or_default();
    for (store, token) in dropped {
        if let Ok(Some(cur)) = read_object(&store).await
            && cur.0.token == token
        {
            let _ = store.delete(LEASE_FILE).await;
        }
    }
}

/// The lease on one root, held until dropped (or [`Lease::release`]d).
#[derive(Debug)]
pub struct Lease {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    /// The locked file: deleted, then unlocked, when dropped.
    Local(#[allow(dead_code)] LocalLease),
    /// A store without conditional puts (S3 with `AWS_CONDITIONAL_PUT=disabled`): nothing
    /// can guard the root; said on stderr.
    Unguarded,
    Object(Box<ObjectLease>),
}

#[derive(Debug)]
struct LocalLease {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl Drop for LocalLease {
    fn drop(&mut self) {
        // Deleted while still locked: a contender that opened it before gets the lock only
        // once this file is gone from the path, and then tries again.
        let _ = std::fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}

#[derive(Debug)]
struct ObjectLease {
    store: RunStore,
    location: String,
    token: String,
    renew: tokio::task::JoinHandle<()>,
    released: bool,
}

impl Lease {
    /// Takes the lease on `store` for `verb`, waiting for a live holder when `--wait-lock`
    /// was given, else failing with [`StorageError::Leased`] naming it.
    ///
    /// # Errors
    /// [`StorageError::Leased`] when another writer holds the root; I/O and store errors.
    pub async fn acquire(store: &RunStore, verb: &str) -> Result<Lease, StorageError> {
        let wait = WAIT.load(Ordering::Relaxed);
        let mut said = false;
        loop {
            let taken = match store.local_path(LEASE_FILE) {
                Some(path) => try_local(&path, verb)?,
                None => try_object(store, verb).await?,
            };
            match taken {
                Ok(lease) => return Ok(lease),
                Err(holder) if wait => {
                    if !said {
                        crate::progress::errln!(
                            "{}: waiting for {} to release the root (--wait-lock)",
                            store.display(),
                            holder
                                .as_ref()
                                .map(Holder::describe)
                                .unwrap_or_else(|| "another writer".into())
                        );
                        said = true;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(holder) => {
                    return Err(StorageError::Leased {
                        root: store.display().to_string(),
                        holder: holder
                            .as_ref()
                            .map(Holder::describe)
                            .unwrap_or_else(|| "another writer".into()),
                    });
                }
            }
        }
    }

    /// Gives the lease back now (an object-store lease is deleted; dropping does it in the
    /// background, which a process that exits right after may not finish).
    pub async fn release(mut self) {
        if let Inner::Object(o) = &mut self.inner {
            o.renew.abort();
            o.released = true;
            set_held(&o.location, false);
            if let Ok(Some(cur)) = read_object(&o.store).await
                && cur.0.token == o.token
            {
                let _ = o.store.delete(LEASE_FILE).await;
            }
        }
    }
}

impl Drop for ObjectLease {
    fn drop(&mut self) {
        self.renew.abort();
        if self.released {
            return;
        }
        set_held(&self.location, false);
        if let Ok(mut d) = DROPPED.lock() {
            d.push((self.store.clone(), self.token.clone()));
        }
    }
}

/// The local lease: `Ok(Ok(lease))` taken, `Ok(Err(holder))` held by a live process.
fn try_local(
    path: &std::path::Path,
    verb: &str,
) -> Result<Result<Lease, Option<Holder>>, StorageError> {
    let io = |source: std::io::Error| StorageError::Io {
        location: format!("{} (the root's lease)", path.display()),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {
            if !names(path, &file) {
                // Deleted by its last holder after we opened it: not the root's lease.
                return try_local(path, verb);
            }
            let me = serde_json::to_vec_pretty(&Holder::ours(verb, None)).unwrap_or_default();
            file.set_len(0).map_err(io)?;
            file.rewind().map_err(io)?;
            file.write_all(&me).map_err(io)?;
            Ok(Ok(Lease {
                inner: Inner::Local(LocalLease {
                    file,
                    path: path.to_path_buf(),
                }),
            }))
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut text = String::new();
            // The holder writes its name right after locking: an empty read names nobody.
            let _ = file.read_to_string(&mut text);
            Ok(Err(serde_json::from_str(&text).ok()))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

/// Whether `path` still names the open `file` (the same inode on the same device).
#[cfg(unix)]
fn names(path: &std::path::Path, file: &std::fs::File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(path), file.metadata()) {
        (Ok(p), Ok(f)) => p.ino() == f.ino() && p.dev() == f.dev(),
        _ => false,
    }
}

#[cfg(not(unix))]
fn names(path: &std::path::Path, _file: &std::fs::File) -> bool {
    path.exists()
}

/// The lease object and its version, if there is one.
async fn read_object(store: &RunStore) -> Result<Option<(Holder, UpdateVersion)>, StorageError> {
    let p = store.path(LEASE_FILE);
    let got = match store.object_store().get(&p).await {
        Ok(g) => g,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(source) => return Err(store.store_err(&p, source)),
    };
    let version = UpdateVersion {
        e_tag: got.meta.e_tag.clone(),
        version: got.meta.version.clone(),
    };
    let bytes = got.bytes().await.map_err(|source| StorageError::Store {
        location: store.location(&p),
        source,
    })?;
    // An unreadable lease object (hand-edited) names nobody and never expires by itself:
    // it is taken over like an expired one.
    let holder = serde_json::from_slice::<Holder>(&bytes).unwrap_or_else(|_| Holder {
        verb: "?".into(),
        host: "?".into(),
        pid: 0,
        proc_start: None,
        acquired: "?".into(),
        expires: Some("1970-01-01T00:00:00Z".into()),
        token: String::new(),
    });
    Ok(Some((holder, version)))
}

/// The object-store lease: `Ok(Ok(lease))` taken, `Ok(Err(holder))` held by a live writer.
async fn try_object(
    store: &RunStore,
    verb: &str,
) -> Result<Result<Lease, Option<Holder>>, StorageError> {
    let p = store.path(LEASE_FILE);
    let location = store.location(&p);
    let ttl = ttl();
    let me = Holder::ours(verb, Some(ttl));
    let body = serde_json::to_vec_pretty(&me).unwrap_or_default();
    let os = store.object_store();
    let put = |mode: PutMode| {
        let (os, p, body) = (os.clone(), p.clone(), body.clone());
        super::retry::retrying(move || {
            let (os, p, body, mode) = (os.clone(), p.clone(), body.clone(), mode.clone());
            async move {
                os.put_opts(
                    &p,
                    PutPayload::from(body),
                    PutOptions {
                        mode,
                        ..Default::default()
                    },
                )
                .await
            }
        })
    };
    let store_err = |source| store.store_err(&p, source);
    let ours = |v: UpdateVersion| object_store::PutResult {
        e_tag: v.e_tag,
        version: v.version,
    };
    let result = match put(PutMode::Create).await {
        Ok(r) => r,
        Err(object_store::Error::NotImplemented { .. }) => {
            eprintln!(
                "{}: warning: this store has no conditional puts, so nothing keeps a second \
                 writer off this root (enable them: AWS_CONDITIONAL_PUT=etag)",
                store.display()
            );
            return Ok(Ok(Lease {
                inner: Inner::Unguarded,
            }));
        }
        Err(object_store::Error::AlreadyExists { .. }) => {
            let Some((holder, version)) = read_object(store).await? else {
                // Released between our put and our read: try again at once.
                return Box::pin(try_object(store, verb)).await;
            };
            if holder.token == me.token {
                // Our own create, whose response a flaky store lost: the client's retry of
                // it then found the object there.
                ours(version)
            } else if !holder.is_stale(&location) {
                return Ok(Err(Some(holder)));
            } else {
                match put(PutMode::Update(version)).await {
                    Ok(r) => r,
                    // Another contender took it over first (or our own update, retried).
                    Err(object_store::Error::Precondition { .. }) => {
                        match read_object(store).await? {
                            Some((h, v)) if h.token == me.token => ours(v),
                            other => return Ok(Err(other.map(|h| h.0))),
                        }
                    }
                    Err(e) => return Err(store_err(e)),
                }
            }
        }
        Err(e) => return Err(store_err(e)),
    };
    // A store that ignores the condition would let two writers both "create": read back.
    match read_object(store).await? {
        Some((h, _)) if h.token == me.token => {}
        other => return Ok(Err(other.map(|h| h.0))),
    }
    set_held(&location, true);
    let renew = tokio::spawn(renew(
        store.clone(),
        me,
        UpdateVersion {
            e_tag: result.e_tag,
            version: result.version,
        },
        ttl,
    ));
    Ok(Ok(Lease {
        inner: Inner::Object(Box::new(ObjectLease {
            store: store.clone(),
            location,
            token: body_token(&body),
            renew,
            released: false,
        })),
    }))
}

fn body_token(body: &[u8]) -> String {
    serde_json::from_slice::<Holder>(body)
        .map(|h| h.token)
        .unwrap_or_default()
}

/// Renews the lease every third of its time to live until aborted; says so once if another
/// writer took it over (only possible when this process stalled past the expiry).
async fn renew(store: RunStore, mut me: Holder, mut version: UpdateVersion, ttl: Duration) {
    let os = store.object_store();
    let p = store.path(LEASE_FILE);
    loop {
        tokio::time::sleep(ttl / 3).await;
        me.expires = Some(
            (chrono::Utc::now() + chrono::Duration::from_std(ttl).unwrap_or_default())
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        );
        let body = serde_json::to_vec_pretty(&me).unwrap_or_default();
        let opts = PutOptions {
            mode: PutMode::Update(version.clone()),
            ..Default::default()
        };
        let put = || os.put_opts(&p, PutPayload::from(body.clone()), opts.clone());
        match super::retry::retrying(put).await {
            Ok(r) => {
                version = UpdateVersion {
                    e_tag: r.e_tag,
                    version: r.version,
                }
            }
            // Our own update, retried after its answer was lost: carry on from it.
            Err(object_store::Error::Precondition { .. }) if matches!(read_object(&store).await, Ok(Some((ref h, _))) if h.token == me.token) => {
                if let Ok(Some((_, v))) = read_object(&store).await {
                    version = v;
                }
            }
            Err(object_store::Error::Precondition { .. }) => {
                tracing::error!(
                    "{}: the root's lease was taken over by another writer after it expired; \
                     this process stalled past its lease",
                    store.display()
                );
                crate::progress::errln!(
                    "{}: warning: the root's lease expired and another writer took it over",
                    store.display()
                );
                return;
            }
            // A transient store error: try again at the next beat, before the expiry.
            Err(e) => tracing::warn!("{}: renewing the lease: {e}", store.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_local_writer_is_refused_naming_the_first_and_takes_it_once_released() {
        let d = tempfile::tempdir().unwrap();
        let store = RunStore::open(d.path().to_str().unwrap()).unwrap();
        let first = Lease::acquire(&store, "call").await.unwrap();
        let e = Lease::acquire(&store, "import").await.unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, StorageError::Leased { .. }), "{msg}");
        assert!(e.is_bad_input());
        assert!(
            msg.contains("`evalflow call`") && msg.contains(&std::process::id().to_string()),
            "{msg}"
        );
        drop(first);
        // Released: the root is left as it was.
        assert!(!d.path().join(LEASE_FILE).exists());
        // A lease file a killed holder left (its lock went with it) is taken over.
        std::fs::write(d.path().join(LEASE_FILE), b"{\"verb\": \"call\"}").unwrap();
        let again = Lease::acquire(&store, "import").await.unwrap();
        let text = std::fs::read_to_string(d.path().join(LEASE_FILE)).unwrap();
        assert!(text.contains("\"import\""), "{text}");
        again.release().await;
        assert!(!d.path().join(LEASE_FILE).exists());
    }

    #[tokio::test]
    async fn an_object_store_lease_is_exclusive_released_and_taken_over_when_its_holder_is_gone() {
        let store = RunStore::open("memory://lease-test/run").unwrap();
        let first = Lease::acquire(&store, "call").await.unwrap();
        let e = Lease::acquire(&store, "rescore").await.unwrap_err();
        assert!(e.to_string().contains("`evalflow call`"), "{e}");
        first.release().await;
        assert!(!store.exists(LEASE_FILE).await.unwrap());
        let second = Lease::acquire(&store, "rescore").await.unwrap();
        // A lease left by a process of this host that is gone: taken over at once.
        std::mem::forget(second);
        set_held(&store.location(&store.path(LEASE_FILE)), false);
        let mut dead = Holder::ours("call", Some(Duration::from_secs(3600)));
        dead.pid = u32::MAX - 1;
        store
            .put(LEASE_FILE, serde_json::to_vec(&dead).unwrap())
            .await
            .unwrap();
        let third = Lease::acquire(&store, "score").await.unwrap();
        let (h, _) = read_object(&store).await.unwrap().unwrap();
        assert_eq!(h.verb, "score");
        third.release().await;
        // A live holder on another host is honoured until its lease expires.
        let mut other = Holder::ours("call", Some(Duration::from_secs(3600)));
        other.host = "elsewhere".into();
        store
            .put(LEASE_FILE, serde_json::to_vec(&other).unwrap())
            .await
            .unwrap();
        assert!(Lease::acquire(&store, "score").await.is_err());
        other.expires = Some("2000-01-01T00:00:00Z".into());
        store
            .put(LEASE_FILE, serde_json::to_vec(&other).unwrap())
            .await
            .unwrap();
        Lease::acquire(&store, "score")
            .await
            .unwrap()
            .release()
            .await;
    }

    #[test]
    fn a_process_is_alive_only_as_the_process_that_started() {
        let me = std::process::id();
        let start = proc_start(me);
        assert!(start.is_some());
        assert!(process_alive(me, start));
        assert!(!process_alive(me, start.map(|s| s + 1)));
        assert!(!process_alive(u32::MAX - 1, None));
        // A holder that exited but was not reaped yet (a zombie) holds nothing.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let t0 = std::time::Instant::now();
        while process_alive(pid, None) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "a zombie counted as alive"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok());
        child.wait().unwrap();
    }
}
