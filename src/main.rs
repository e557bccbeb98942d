//! The evalflow binary: parse, run, map to an explicit exit code.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

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

/// Whether the command's output is its product (see `Command::writes_a_run`), so a reader
/// that went away ends it.
static OUTPUT_IS_THE_PRODUCT: AtomicBool = AtomicBool::new(true);

fn main() -> ExitCode {
    // A closed pipe (`evalflow sql ... | head`) is not an error: exit quietly. A verb that
    // writes a run drops its messages on a closed pipe and finishes (`progress::outln`); a
    // broken pipe that still reaches here in one (a print not converted) ends it non-zero,
    // never as a success it did not reach.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("Broken pipe") {
            if OUTPUT_IS_THE_PRODUCT.load(Ordering::Relaxed) {
                std::process::exit(0);
            }
            // stderr may be the closed pipe: the exit code says it.
            std::process::exit(i32::from(cli::EXIT_INTERNAL));
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
    OUTPUT_IS_THE_PRODUCT.store(!cli.command.writes_a_run(), Ordering::Relaxed);
    tracing_subscriber::fmt()
        // A closed stderr drops log lines; the default reports that on stderr, by a print
        // that panics there.
        .log_internal_errors(false)
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
            // The error is said if stderr is open; the exit code says it either way.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
