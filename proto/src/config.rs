//! Settings from a TOML file beneath the command line (and [`parse_size`], the byte counts
//! every component's flags take): every component reads `--config FILE`
//! (or `REGIONS_CONFIG`), and a flag or a `REGIONS_*` variable given explicitly takes
//! precedence over the file, which takes precedence over the built-in default.
//! `--print-config` prints the merged settings and where each came from.
//!
//! The file's keys are the long flag names (`data-dir` or `data_dir`), with the positional
//! arguments under their value names (`mountpoint`). For a program with subcommands (regionfs),
//! top-level keys apply to whichever subcommand runs, and a table named after a subcommand
//! (`[mount]`, `[up]`) applies to that one only and wins over top-level keys. A key that no
//! subcommand knows is an error, so a typo does not go unnoticed.
//!
//! The merge works on the command line itself: the program's arguments are parsed once to learn
//! which settings were given explicitly, the file's values for the others are appended as
//! `--key=value` arguments, and the result is parsed again. Every value therefore passes
//! through the same parser and checks as a flag.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command, CommandFactory};

/// The two flags every component has; `#[command(flatten)]` it into the argument struct (of
/// each subcommand, for programs with subcommands).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ConfigArgs {
    /// TOML file of settings (keys are the long flag names); flags and environment variables
    /// given explicitly take precedence over it.
    #[arg(long = "config", env = "REGIONS_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the merged settings (flags, environment, config file, defaults) as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// Why a configuration file could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the config file {path}: {source}; check the --config path")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the config file {path} is not valid TOML: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error(
        "unknown key `{key}` in the config file {path}; the keys are the long flag names: {known}"
    )]
    UnknownKey {
        path: PathBuf,
        key: String,
        known: String,
    },
    #[error(
        "key `{key}` in the config file {path} has a value of an unsupported type ({kind}); write a string, number or boolean (or an array of them)"
    )]
    BadValue {
        path: PathBuf,
        key: String,
        kind: &'static str,
    },
}

/// Parses the process's command line with the config file merged in, exiting as clap does on
/// `--help`, `--version` and errors, and after printing on `--print-config`.
pub fn parse<T: clap::Parser>() -> T {
    parse_from(std::env::args_os())
}

/// [`parse`] with explicit arguments (the first is the program name).
pub fn parse_from<T, I, A>(args: I) -> T
where
    T: clap::Parser,
    I: IntoIterator<Item = A>,
    A: Into<OsString> + Clone,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let merged = match merge::<T>(&args) {
        Ok(merged) => merged,
        Err(e) => {
            T::command()
                .error(clap::error::ErrorKind::InvalidValue, e.to_string())
                .exit();
        }
    };
    let matches = T::command().get_matches_from(&merged.args);
    let value = match T::from_arg_matches(&matches) {
        Ok(value) => value,
        Err(e) => e.format(&mut T::command()).exit(),
    };
    let (command, leaf) = leaf(T::command(), &matches);
    if leaf.try_get_one::<bool>("print_config").ok().flatten() == Some(&true) {
        print!("{}", render(&command, leaf, &merged.from_file));
        std::process::exit(0);
    }
    value
}

/// The arguments with the config file's settings appended for every setting not given by a
/// flag or an environment variable. Arguments that do not parse are returned unchanged, so
/// the real parse reports the problem (or prints help).
pub fn merge_config<T: CommandFactory>(args: &[OsString]) -> Result<Vec<OsString>, ConfigError> {
    merge::<T>(args).map(|m| m.args)
}

/// Arguments after the merge, and the ids of the settings the file supplied.
#[derive(Debug, Default)]
struct Merged {
    args: Vec<OsString>,
    from_file: Vec<String>,
}

fn merge<T: CommandFactory>(args: &[OsString]) -> Result<Merged, ConfigError> {
    let unchanged = || Merged {
        args: args.to_vec(),
        from_file: Vec::new(),
    };
    let Ok(matches) = relaxed(T::command()).try_get_matches_from(args) else {
        return Ok(unchanged());
    };
    let root = T::command();
    let mut path_names = Vec::new();
    let mut leaf_matches = &matches;
    while let Some((name, sub)) = leaf_matches.subcommand() {
        path_names.push(name.to_owned());
        leaf_matches = sub;
    }
    let Some(file) = leaf_matches
        .try_get_one::<PathBuf>("config")
        .ok()
        .flatten()
        .cloned()
    else {
        return Ok(unchanged());
    };
    let mut command = root.clone();
    for name in &path_names {
        command = match command.find_subcommand(name) {
            Some(sub) => sub.clone(),
            None => return Ok(unchanged()),
        };
    }
    let table = read_table(&file)?;
    let settings = settings_for(&root, &command, path_names.last(), &table, &file)?;
    let mut extra: Vec<OsString> = Vec::new();
    let mut positionals: Vec<OsString> = Vec::new();
    let mut from_file = Vec::new();
    for (id, values) in settings {
        let Some(arg) = command.get_arguments().find(|a| a.get_id().as_str() == id) else {
            continue;
        };
        if matches!(
            leaf_matches.value_source(&id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        from_file.push(id.clone());
        match (arg.get_long(), arg.get_action()) {
            (Some(long), ArgAction::SetTrue) => {
                if values.iter().any(|v| v == "true") {
                    extra.push(format!("--{long}").into());
                }
            }
            (Some(long), ArgAction::SetFalse) => {
                if values.iter().any(|v| v == "false") {
                    extra.push(format!("--{long}").into());
                }
            }
            (Some(long), _) => {
                for v in values {
                    extra.push(format!("--{long}={v}").into());
                }
            }
            (None, _) => positionals.extend(values.into_iter().map(OsString::from)),
        }
    }
    // Appended before a `--` that ends the options (a command to run, say).
    let end = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let mut merged = args[..end].to_vec();
    merged.extend(extra);
    merged.extend(positionals);
    merged.extend_from_slice(&args[end..]);
    Ok(Merged {
        args: merged,
        from_file,
    })
}

/// The command with nothing required, to learn what was given before the file fills gaps.
fn relaxed(command: Command) -> Command {
    command
        .mut_args(|a| a.required(false))
        .subcommand_required(false)
        .arg_required_else_help(false)
        .mut_subcommands(relaxed)
}

/// The deepest subcommand that runs, and its matches.
fn leaf(mut command: Command, matches: &ArgMatches) -> (Command, &ArgMatches) {
    let mut m = matches;
    while let Some((name, sub)) = m.subcommand() {
        command = match command.find_subcommand(name) {
            Some(c) => c.clone(),
            None => break,
        };
        m = sub;
    }
    (command, m)
}

fn read_table(path: &Path) -> Result<toml::Table, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    text.parse::<toml::Table>()
        .map_err(|e| ConfigError::Syntax {
            path: path.to_owned(),
            message: e.to_string(),
        })
}

/// Whether `arg` is a setting a config file may hold (not `--config`, `--print-config`,
/// `--help` or `--version`).
fn is_setting(arg: &clap::Arg) -> bool {
    !matches!(
        arg.get_id().as_str(),
        "config" | "print_config" | "help" | "version"
    )
}

/// Whether `arg` is listed to people: hidden arguments (test hooks) are not.
fn is_documented(arg: &clap::Arg) -> bool {
    !arg.is_hide_set()
}

/// The argument a key names in `command`, by long name or id, `-` and `_` alike.
fn arg_id(command: &Command, key: &str) -> Option<String> {
    let norm = key.replace('-', "_");
    command
        .get_arguments()
        .filter(|a| is_setting(a))
        .find(|a| {
            a.get_id().as_str() == norm || a.get_long().is_some_and(|l| l.replace('-', "_") == norm)
        })
        .map(|a| a.get_id().to_string())
}

/// Whether any command in the tree has an argument for `key`.
fn known_anywhere(command: &Command, key: &str) -> bool {
    arg_id(command, key).is_some() || command.get_subcommands().any(|s| known_anywhere(s, key))
}

/// The file's settings for the running command: (argument id, values as text).
fn settings_for(
    root: &Command,
    command: &Command,
    subcommand: Option<&String>,
    table: &toml::Table,
    path: &Path,
) -> Result<Vec<(String, Vec<String>)>, ConfigError> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    let mut put = |key: &str, value: &toml::Value, scoped: bool| -> Result<(), ConfigError> {
        let id = match arg_id(command, key) {
            Some(id) => id,
            None if !scoped && known_anywhere(root, key) => return Ok(()),
            None => {
                return Err(ConfigError::UnknownKey {
                    path: path.to_owned(),
                    key: key.to_owned(),
                    known: known_keys(command),
                });
            }
        };
        let values = values_of(value).ok_or_else(|| ConfigError::BadValue {
            path: path.to_owned(),
            key: key.to_owned(),
            kind: value.type_str(),
        })?;
        out.retain(|(i, _)| *i != id);
        out.push((id, values));
        Ok(())
    };
    let subcommand_names: Vec<&str> = root.get_subcommands().map(|s| s.get_name()).collect();
    for (key, value) in table {
        if value.is_table() && subcommand_names.contains(&key.as_str()) {
            continue;
        }
        put(key, value, false)?;
    }
    if let Some(name) = subcommand
        && let Some(toml::Value::Table(scoped)) = table.get(name.as_str())
    {
        for (key, value) in scoped {
            put(key, value, true)?;
        }
    }
    Ok(out)
}

fn values_of(value: &toml::Value) -> Option<Vec<String>> {
    match value {
        toml::Value::String(s) => Some(vec![s.clone()]),
        toml::Value::Integer(i) => Some(vec![i.to_string()]),
        toml::Value::Float(f) => Some(vec![f.to_string()]),
        toml::Value::Boolean(b) => Some(vec![b.to_string()]),
        toml::Value::Array(items) => items
            .iter()
            .map(|v| values_of(v).and_then(|mut v| (v.len() == 1).then(|| v.remove(0))))
            .collect(),
        toml::Value::Datetime(_) | toml::Value::Table(_) => None,
    }
}

fn known_keys(command: &Command) -> String {
    command
        .get_arguments()
        .filter(|a| is_setting(a) && is_documented(a))
        .map(|a| {
            a.get_long()
                .map(str::to_owned)
                .unwrap_or_else(|| a.get_id().to_string())
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The merged settings as TOML, each with a comment saying where it came from (`from_file`:
/// the ids of the settings the config file supplied).
fn render(command: &Command, matches: &ArgMatches, from_file: &[String]) -> String {
    let mut out = String::new();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        if !is_setting(arg) || !is_documented(arg) {
            continue;
        }
        let key = arg
            .get_long()
            .map(str::to_owned)
            .unwrap_or_else(|| id.to_owned());
        let source = match matches.value_source(id) {
            Some(ValueSource::CommandLine) if from_file.iter().any(|f| f == id) => "config file",
            Some(ValueSource::CommandLine) => "flag",
            Some(ValueSource::EnvVariable) => "environment",
            Some(ValueSource::DefaultValue) => "default",
            _ => {
                out.push_str(&format!("# {key} is not set\n"));
                continue;
            }
        };
        let values: Vec<String> = matches
            .get_raw(id)
            .map(|raw| raw.map(|v| v.to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let rendered = match (arg.get_action(), values.as_slice()) {
            (ArgAction::SetTrue | ArgAction::SetFalse, [v]) => v.clone(),
            (_, [v]) => toml_scalar(v),
            (_, vs) => format!(
                "[{}]",
                vs.iter()
                    .map(|v| toml_scalar(v))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        out.push_str(&format!("{key} = {rendered}  # {source}\n"));
    }
    out
}

/// A value as TOML: integers and booleans bare, everything else a quoted string.
fn toml_scalar(v: &str) -> String {
    if v.parse::<i64>().is_ok() || v == "true" || v == "false" {
        v.to_owned()
    } else {
        toml::Value::String(v.to_owned()).to_string()
    }
}

/// Parses a byte count with an optional K, M, G or T suffix (powers of 1024; `KiB`, `KB` and
/// `B` spellings are accepted too).
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, suffix) = t.split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size: write e.g. 4G, 512M or 1048576"))?;
    let shift = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        other => {
            return Err(format!(
                "unknown size suffix {other:?} in {text:?}: use K, M, G or T"
            ));
        }
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4 << 10));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert!(parse_size("G").is_err());
        assert!(parse_size("4X").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert!(parse_size("-1").is_err());
    }

    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Demo {
        #[arg(long, env = "REGIONS_TEST_CFG_PORT", default_value_t = 7)]
        port: u16,
        #[arg(long, env = "REGIONS_TEST_CFG_NAME", default_value = "plain")]
        name: String,
        #[arg(long, env = "REGIONS_TEST_CFG_ID")]
        host_id: u32,
        #[arg(long)]
        verbose: bool,
        #[arg(long)]
        tag: Vec<String>,
        #[command(flatten)]
        config: ConfigArgs,
    }

    #[derive(Parser, Debug)]
    struct Multi {
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(clap::Subcommand, Debug)]
    enum Sub {
        Mount {
            #[arg(long, default_value_t = 4)]
            threads: usize,
            mountpoint: PathBuf,
            #[command(flatten)]
            config: ConfigArgs,
        },
        Up {
            #[arg(long, default_value = "1G")]
            memory: String,
            #[arg(long, default_value_t = 4)]
            threads: usize,
            #[command(flatten)]
            config: ConfigArgs,
        },
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(f.path(), text).expect("write config");
        f
    }

    fn demo(args: &[&str]) -> Result<Demo, String> {
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let merged = merge_config::<Demo>(&args).map_err(|e| e.to_string())?;
        Demo::try_parse_from(merged).map_err(|e| e.to_string())
    }

    // Environment variables are process-wide and other tests run in parallel threads, so the
    // environment's place in the order is tested on a real binary (tests/tests/operability.rs).
    #[test]
    fn flags_beat_the_file_which_beats_defaults() {
        let f = file(
            "port = 9\nname = \"from-file\"\nhost-id = 3\nverbose = true\ntag = [\"a\", \"b\"]\n",
        );
        let path = f.path().to_str().expect("utf-8 temp path");

        let d = demo(&["demo", "--config", path]).expect("parse");
        assert_eq!((d.port, d.name.as_str(), d.host_id), (9, "from-file", 3));
        assert!(d.verbose);
        assert_eq!(d.tag, ["a", "b"]);

        let d = demo(&["demo", "--config", path, "--port", "11", "--tag", "c"]).expect("parse");
        assert_eq!((d.port, d.name.as_str(), d.host_id), (11, "from-file", 3));
        assert_eq!(d.tag, ["c"]);

        let d = demo(&["demo", "--host-id", "5"]).expect("no file: defaults");
        assert_eq!((d.port, d.name.as_str(), d.host_id), (7, "plain", 5));
        assert!(!d.verbose);
    }

    #[test]
    fn a_required_setting_may_come_from_the_file_only() {
        let f = file("host_id = 12\n");
        let d = demo(&["demo", "--config", f.path().to_str().expect("utf-8")]).expect("parse");
        assert_eq!(d.host_id, 12);
        let err = demo(&["demo"]).expect_err("host id missing everywhere");
        assert!(err.contains("--host-id"), "{err}");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors_that_name_the_key() {
        let f = file("prot = 9\nhost-id = 1\n");
        let err = demo(&["demo", "--config", f.path().to_str().expect("utf-8")]).expect_err("typo");
        assert!(
            err.contains("unknown key `prot`") && err.contains("port"),
            "{err}"
        );

        let f = file("port = \"many\"\nhost-id = 1\n");
        let err = demo(&["demo", "--config", f.path().to_str().expect("utf-8")]).expect_err("bad");
        assert!(err.contains("many"), "{err}");

        let f = file("port = 1979-05-27\n");
        let err = demo(&["demo", "--config", f.path().to_str().expect("utf-8")]).expect_err("date");
        assert!(err.contains("unsupported type"), "{err}");

        let err = demo(&["demo", "--config", "/nonexistent/regions.toml"]).expect_err("missing");
        assert!(err.contains("cannot read the config file"), "{err}");

        let f = file("port = [\n");
        let err = demo(&["demo", "--config", f.path().to_str().expect("utf-8")]).expect_err("toml");
        assert!(err.contains("not valid TOML"), "{err}");
    }

    #[test]
    fn subcommand_tables_win_over_top_level_keys_and_positionals_fill_in() {
        let f =
            file("threads = 2\nmemory = \"8G\"\nmountpoint = \"/mnt/r\"\n[mount]\nthreads = 6\n");
        let path = f.path().to_str().expect("utf-8");
        let args: Vec<OsString> = ["m", "mount", "--config", path]
            .iter()
            .map(OsString::from)
            .collect();
        let m = Multi::try_parse_from(merge_config::<Multi>(&args).expect("merge")).expect("parse");
        match m.command {
            Sub::Mount {
                threads,
                mountpoint,
                ..
            } => {
                assert_eq!(threads, 6);
                assert_eq!(mountpoint, PathBuf::from("/mnt/r"));
            }
            Sub::Up { .. } => panic!("mount expected"),
        }
        let args: Vec<OsString> = ["m", "up", "--config", path]
            .iter()
            .map(OsString::from)
            .collect();
        let m = Multi::try_parse_from(merge_config::<Multi>(&args).expect("merge")).expect("parse");
        match m.command {
            Sub::Up {
                threads, memory, ..
            } => assert_eq!((threads, memory.as_str()), (2, "8G")),
            Sub::Mount { .. } => panic!("up expected"),
        }
        // A key no subcommand knows is still an error.
        let f = file("thredas = 2\n");
        let args: Vec<OsString> = ["m", "up", "--config", f.path().to_str().expect("utf-8")]
            .iter()
            .map(OsString::from)
            .collect();
        assert!(merge_config::<Multi>(&args).is_err());
    }

    #[test]
    fn print_config_renders_toml_that_reads_back() {
        let f = file("port = 9\nhost-id = 3\n");
        let path = f.path().to_str().expect("utf-8");
        let args: Vec<OsString> = ["demo", "--config", path, "--name", "x y"]
            .iter()
            .map(OsString::from)
            .collect();
        let merged = merge::<Demo>(&args).expect("merge");
        let matches = Demo::command().get_matches_from(&merged.args);
        let text = render(&Demo::command(), &matches, &merged.from_file);
        assert!(text.contains("port = 9  # config file"), "{text}");
        assert!(text.contains("name = \"x y\"  # flag"), "{text}");
        assert!(text.contains("verbose = false  # default"), "{text}");
        // The printed settings are themselves a valid config file.
        let again = file(&text);
        let d =
            demo(&["demo", "--config", again.path().to_str().expect("utf-8")]).expect("reads back");
        assert_eq!((d.port, d.name.as_str(), d.host_id), (9, "x y", 3));
    }
}
