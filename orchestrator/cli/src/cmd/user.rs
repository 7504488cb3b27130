//! `trellis user`: a server's users and their tokens (see [`crate::access`]).

use crate::access::Users;
use anyhow::Result;
use std::path::PathBuf;

/// `trellis user …`.
#[derive(Debug, clap::Subcommand)]
pub enum UserCommand {
    /// Add a user with a fresh token; prints the token file, which is what they pass as
    /// `--token-file`. A running server takes the user at once.
    Add {
        /// The user's name (letters, digits, `-`, `_`, `.`).
        name: String,
        #[command(flatten)]
        data: DataDir,
    },
    /// List the users.
    List {
        #[command(flatten)]
        data: DataDir,
    },
    /// Remove a user: their token stops working at once; their jobs stay (the admin sees them).
    Remove {
        /// The user's name.
        name: String,
        #[command(flatten)]
        data: DataDir,
    },
}

/// The server's data dir.
#[derive(Debug, clap::Args)]
pub struct DataDir {
    /// The data dir of the server (`trellis serve --data-dir`).
    #[arg(long, default_value = "trellis-data")]
    data_dir: PathBuf,
}

impl UserCommand {
    pub fn run(self) -> Result<()> {
        match self {
            UserCommand::Add { name, data } => {
                let path = Users::at(&data.data_dir).add(&name)?;
                println!("{}", path.display());
                eprintln!(
                    "user {name} added: give them {} (they call with --token-file); they see and change only their own jobs",
                    path.display()
                );
            }
            UserCommand::List { data } => {
                let users = Users::at(&data.data_dir);
                let names = users.names()?;
                if names.is_empty() {
                    eprintln!(
                        "no users in {}: only the admin's token calls the job API",
                        users.dir().display()
                    );
                }
                for name in names {
                    println!("{name}\t{}", users.token_file(&name).display());
                }
            }
            UserCommand::Remove { name, data } => {
                Users::at(&data.data_dir).remove(&name)?;
                eprintln!("user {name} removed: their token no longer works; their jobs stay");
            }
        }
        Ok(())
    }
}
