//! `bertkit reference`: every command's flags as Markdown, from clap's own command tree (the
//! same definitions `--help` prints), for `docs/configuration.md` (`make docs` writes it in;
//! a test fails where the file and the binary disagree).

use clap::CommandFactory;

use crate::flags::Cli;

/// The Markdown reference of every command and its flags.
pub(crate) fn markdown() -> String {
    let mut out = String::new();
    let root = Cli::command();
    for command in root.get_subcommands() {
        leaves(command, "bertkit", &mut out);
    }
    out
}

/// Writes `command` (under `parent`) where it runs, else each of its subcommands.
fn leaves(command: &clap::Command, parent: &str, out: &mut String) {
    if command.is_hide_set() || command.get_name() == "help" {
        return;
    }
    let path = format!("{parent} {}", command.get_name());
    if command.has_subcommands() {
        for sub in command.get_subcommands() {
            leaves(sub, &path, out);
        }
        return;
    }
    out.push_str(&format!("### `{path}`\n\n"));
    if let Some(about) = command.get_about() {
        out.push_str(&format!("{}\n\n", one_line(&about.to_string())));
    }
    let args: Vec<&clap::Arg> = command
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if args.is_empty() {
        out.push_str("No flags.\n\n");
        return;
    }
    out.push_str("| flag | value | default | meaning |\n|---|---|---|---|\n");
    for arg in args {
        out.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            name(arg),
            value(arg),
            default(arg),
            cell(&arg.get_help().map(|h| h.to_string()).unwrap_or_default())
        ));
    }
    out.push('\n');
}

/// `--long` (with `-s`), or `<NAME>` for a positional argument.
fn name(arg: &clap::Arg) -> String {
    match (arg.get_long(), arg.get_short()) {
        (Some(long), Some(short)) => format!("`--{long}`, `-{short}`"),
        (Some(long), None) => format!("`--{long}`"),
        (None, Some(short)) => format!("`-{short}`"),
        (None, None) => format!("`<{}>`", arg.get_id().as_str().to_uppercase()),
    }
}

/// What the flag takes: nothing (a switch), its accepted values, or its value's name; and
/// whether it repeats or is required.
fn value(arg: &clap::Arg) -> String {
    let mut text = if !arg.get_action().takes_values() {
        "switch".to_string()
    } else {
        let possible: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        if possible.is_empty() {
            arg.get_value_names()
                .map(|n| {
                    n.iter()
                        .map(|n| n.to_string())
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_else(|| arg.get_id().as_str().to_uppercase())
        } else {
            possible.join(", ")
        }
    };
    if matches!(arg.get_action(), clap::ArgAction::Append) {
        text.push_str(" (repeatable)");
    }
    if arg.is_required_set() {
        text.push_str(" (required)");
    }
    text
}

/// The default value, or `–`.
fn default(arg: &clap::Arg) -> String {
    let values: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if values.is_empty() || !arg.get_action().takes_values() {
        "–".to_string()
    } else {
        format!("`{}`", values.join(" "))
    }
}

/// A help text as one table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    one_line(text).replace('|', "\\|")
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
