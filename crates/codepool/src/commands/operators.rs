//! `codepool operators`: the accounts of the console (/console of `codepool
//! api`): add, list, disable, passwd. Passwords are read from the terminal
//! (not echoed) or, with `--password-stdin`, from the first line of
//! standard input; only their argon2id hashes are stored.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::Context;
use clap::{Args, Subcommand};
use codepool_issuance::operators::{self, Role};

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool operators add --name alice --role support
  printf '%s\\n' \"$PASSWORD\" | codepool operators add --name bob --role admin --password-stdin
  codepool operators list
  codepool operators passwd --name alice
  codepool operators disable --name alice

Roles: viewer (stock and stats), support (and order lookup with codes
masked, resend SMS, void with a reason), admin (everything: imports,
recall, pause/resume, settings, reveal, dead letters, API keys, operators,
the audit log). Disabling an account, or a new password, ends its sessions.
Each change is written to the audit collection with the OS user and host
(never the password).")]
pub struct OperatorsArgs {
    #[command(subcommand)]
    pub command: OperatorsCommand,
}

#[derive(Debug, Subcommand)]
pub enum OperatorsCommand {
    /// Add an operator.
    Add {
        #[arg(long)]
        name: String,
        /// viewer, support or admin.
        #[arg(long, value_parser = parse_role)]
        role: Role,
        /// Read the password from the first line of standard input.
        #[arg(long)]
        password_stdin: bool,
    },
    /// List operators: name, role, created, disabled.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Disable an operator; their sessions end.
    Disable {
        #[arg(long)]
        name: String,
    },
    /// Set an operator's password (and enable the account); sessions end.
    Passwd {
        #[arg(long)]
        name: String,
        /// Read the password from the first line of standard input.
        #[arg(long)]
        password_stdin: bool,
    },
}

fn parse_role(s: &str) -> Result<Role, String> {
    Role::parse(s).ok_or_else(|| format!("unknown role {s:?}; use viewer, support or admin"))
}

/// The new password: the first line of stdin, or typed twice at a terminal.
fn read_password(from_stdin: bool) -> anyhow::Result<String> {
    let stdin = std::io::stdin();
    if from_stdin || !stdin.is_terminal() {
        let mut line = String::new();
        stdin
            .lock()
            .read_line(&mut line)
            .context("cannot read the password from standard input")?;
        return Ok(line.trim_end_matches(['\r', '\n']).to_owned());
    }
    let ask = |prompt: &str| -> anyhow::Result<String> {
        eprint!("{prompt}");
        std::io::stderr().flush()?;
        let _quiet = Echo::off();
        let mut line = String::new();
        stdin.lock().read_line(&mut line)?;
        eprintln!();
        Ok(line.trim_end_matches(['\r', '\n']).to_owned())
    };
    let first = ask("password: ")?;
    if ask("again: ")? != first {
        anyhow::bail!("the two passwords differ; run the command again");
    }
    Ok(first)
}

/// Terminal echo off while it lives (`stty`), so a typed password is not shown.
struct Echo;

impl Echo {
    fn off() -> Self {
        let _ = std::process::Command::new("stty")
            .arg("-echo")
            .stdin(std::process::Stdio::inherit())
            .status();
        Echo
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        let _ = std::process::Command::new("stty")
            .arg("echo")
            .stdin(std::process::Stdio::inherit())
            .status();
    }
}

pub async fn run(cfg: &Config, args: OperatorsArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    match args.command {
        OperatorsCommand::Add {
            name,
            role,
            password_stdin,
        } => {
            let password = read_password(password_stdin)?;
            let actor = super::actor("operators add");
            let op = operators::add(&store, &name, role, &password, &actor).await?;
            say!(
                "added operator {:?} as {}; they sign in at /console of `codepool api`",
                op.name,
                op.role.as_str()
            );
        }
        OperatorsCommand::List { json } => list(&store, json).await?,
        OperatorsCommand::Disable { name } => {
            let op = operators::disable(&store, &name, &super::actor("operators disable")).await?;
            say!("disabled operator {:?}; their sessions ended", op.name);
        }
        OperatorsCommand::Passwd {
            name,
            password_stdin,
        } => {
            let password = read_password(password_stdin)?;
            let actor = super::actor("operators passwd");
            operators::passwd(&store, &name, &password, &actor).await?;
            say!("changed the password of {name:?}; their sessions ended");
        }
    }
    Ok(crate::exit::OK)
}

async fn list(store: &codepool_store::Store, json: bool) -> anyhow::Result<()> {
    let all = operators::list(store).await?;
    if json {
        let rows: Vec<_> = all
            .iter()
            .map(|o| {
                serde_json::json!({
                    "name": o.name, "role": o.role.as_str(),
                    "created_at": o.created_at.to_chrono().to_rfc3339(),
                    "disabled_at": o.disabled_at.map(|t| t.to_chrono().to_rfc3339()),
                })
            })
            .collect();
        say_json!(serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    say!("{:<24} {:<8} {:<21} DISABLED", "NAME", "ROLE", "CREATED");
    for o in &all {
        say!(
            "{:<24} {:<8} {:<21} {}",
            o.name,
            o.role.as_str(),
            super::target::when(Some(o.created_at)),
            o.disabled_at
                .map_or("-".to_owned(), |t| super::target::when(Some(t))),
        );
    }
    Ok(())
}
