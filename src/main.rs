//! The evalflow binary: parse, run, map to an explicit exit code.

use std::process::ExitCode;

use clap::Parser;
use evalflow::cli::{self, Cli};

/// jemalloc rather than the system allocator: stages allocate on some threads and free on
/// others (rayon parses, tokio writes), which glibc's arenas serialise and do not give back
/// (see Cargo.toml).
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read when it starts (`_RJEM_MALLOC_CONF` still overrides them). A
/// stage's live heap is a fraction of its RSS (201 MB of 550 MB scoring 10M calls, measured
/// with heaptrack): the rest was freed pages kept per arena, eight arenas on two cores, for
/// ten seconds. One arena per CPU, and freed pages returned after a second by jemalloc's own
/// background thread (the stage's threads never wait for it): scoring 10M calls peaks at
/// 395 MB against 520 MB, in the same time.
///
/// On Linux, transparent huge pages for the heap and jemalloc's own metadata (`thp:always`,
/// `metadata_thp:always`: jemalloc asks for them with `madvise`, where the kernel leaves the
/// choice to the program; elsewhere jemalloc would refuse the options on stderr): an
/// import's tables that outgrow the caches (the sample counts of 10M records: a million
/// (case, model) pairs, each looked up by a hash) miss the TLB on most lookups. Importing the
/// 10M repeated corpus, seven pairs of runs with and without, alternating: 0.86 to 1.00 of
/// the time (median 0.94; the gain is largest when the machine is slow), at 6% more peak
/// RSS; scoring and SQL stages ran as fast at 10-15% more RSS (session 31,
/// docs/foreign-data.md).
#[cfg(all(not(target_env = "msvc"), target_os = "linux"))]
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: MallocConf = MallocConf(
    c"percpu_arena:percpu,background_thread:true,dirty_decay_ms:1000,thp:always,metadata_thp:always".as_ptr(),
);

/// [`MALLOC_CONF`] where the kernel has no transparent huge pages to ask for.
#[cfg(all(not(target_env = "msvc"), not(target_os = "linux")))]
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: MallocConf =
    MallocConf(c"percpu_arena:percpu,background_thread:true,dirty_decay_ms:1000".as_ptr());

/// A C string pointer jemalloc reads (`const char *malloc_conf`).
#[cfg(not(target_env = "msvc"))]
#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);

// SAFETY: the pointer is to a static, immutable C string literal.
#[cfg(not(target_env = "msvc"))]
unsafe impl Sync for MallocConf {}

fn main() -> ExitCode {
    // A closed pipe (`evalflow sql ... | head`) is not an error: exit quietly.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default_hook(info);
    }));
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() {
                cli::EXIT_BAD_INPUT
            } else {
                0
            };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(t) = cli.threads {
        builder.worker_threads(t as usize);
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(cli::EXIT_INTERNAL);
        }
    };
    match rt.block_on(cli::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
