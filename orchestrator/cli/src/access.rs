//! Who may call a server, and as whom. Three kinds of token, each a file in the data dir:
//!
//! - the **admin** token (`DATA_DIR/token`): the job API, every job;
//! - **users'** tokens (`DATA_DIR/users/NAME.token`, made by `trellis user add NAME`): the job
//!   API, each user's own jobs only — a user lists, watches, resumes and cancels what they
//!   submitted and nothing else;
//! - the **agents'** token (`DATA_DIR/agent-token`): agent registration and the head ↔ agent
//!   protocol; on the job API only `GetCluster` (what `trellis doctor --head` asks from a host
//!   about to join), never a job (and the API's tokens never register an agent).
//!
//! A call on a loopback listener may come without a token, as the admin, only while the server
//! has no users: once it has some, every call presents one.
//!
//! Owns: the users folder (add, list, remove), telling a call's token apart ([`ApiGuard`] puts
//! the [`Caller`] in the request), and what a caller may do with a job. Does not own: the
//! tokens' format and comparison (`actors::Token`), nor the guard on agent calls (`actors::Head`
//! with the agents' token).

use actors::Token;
use orchestrator::store::Job;
use std::path::{Path, PathBuf};
use tonic::{Request, Status};

/// Who a job API call comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// The admin token, or no token on a loopback server without users: every job.
    Admin,
    /// A user's token: that user's jobs.
    User(String),
    /// The agents' token: the cluster's state, no job.
    Agent,
}

impl Caller {
    /// The caller of a request the guard let through; a request that did not pass the guard
    /// (a wiring mistake) gets the least: the agents' rights, no job.
    pub fn of<T>(request: &Request<T>) -> Caller {
        request
            .extensions()
            .get::<Caller>()
            .cloned()
            .unwrap_or(Caller::Agent)
    }

    /// The owner of the jobs this caller submits ([`Job::owner`]); PERMISSION_DENIED for the
    /// agents' token, which has no jobs.
    pub fn owner(&self) -> Result<Option<&str>, Status> {
        match self {
            Caller::Admin => Ok(None),
            Caller::User(name) => Ok(Some(name)),
            Caller::Agent => Err(Status::permission_denied(
                "the agents' token cannot submit, see or change jobs: use the admin token (the server's DATA_DIR/token) or a user's (`trellis user add NAME`)",
            )),
        }
    }

    /// Whether this caller may see and change a job owned by `owner`.
    pub fn may_use(&self, owner: Option<&str>) -> bool {
        match self {
            Caller::Admin => true,
            Caller::User(name) => owner == Some(name.as_str()),
            Caller::Agent => false,
        }
    }

    /// PERMISSION_DENIED unless this caller may see and change `job`.
    pub fn check(&self, job: &Job) -> Result<(), Status> {
        if self.may_use(job.owner.as_deref()) {
            return Ok(());
        }
        let name = self.owner()?.unwrap_or("admin");
        Err(Status::permission_denied(format!(
            "job {} is not yours: user {name} may only see and change the jobs {name} submitted",
            job.id
        )))
    }
}

/// Why a user could not be added, listed or removed.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    /// A name that cannot be a user's.
    #[error(
        "user name `{0}`: use 1 to 64 letters, digits, `-`, `_` or `.`, not starting with `.` (and not `admin`)"
    )]
    Name(String),
    /// `add` of a user who exists.
    #[error(
        "user {name} exists ({path}); `trellis user remove {name}` first to give them a new token"
    )]
    Exists {
        /// The name.
        name: String,
        /// Their token file.
        path: PathBuf,
    },
    /// `remove` of a user who does not exist.
    #[error("no user {name} in {dir}")]
    NoUser {
        /// The name.
        name: String,
        /// The users folder.
        dir: PathBuf,
    },
    /// A file or folder could not be read or written.
    #[error("{path}: {message}")]
    File {
        /// The file or folder.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

/// A server's users: one token file per user in `DATA_DIR/users`.
#[derive(Clone, Debug)]
pub struct Users {
    dir: PathBuf,
}

const SUFFIX: &str = ".token";

impl Users {
    /// The users of the server whose data dir is `data_dir`.
    pub fn at(data_dir: &Path) -> Users {
        Users {
            dir: data_dir.join("users"),
        }
    }

    /// The folder of token files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The token file of user `name`.
    pub fn token_file(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}{SUFFIX}"))
    }

    fn valid(name: &str) -> Result<(), AccessError> {
        let ok = (1..=64).contains(&name.len())
            && !name.starts_with('.')
            && name != "admin"
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if ok {
            Ok(())
        } else {
            Err(AccessError::Name(name.to_string()))
        }
    }

    fn file_err(path: &Path, e: impl std::fmt::Display) -> AccessError {
        AccessError::File {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    }

    /// Adds user `name` with a fresh token; returns their token file (mode 0600), which is what
    /// they pass as `--token-file`. Takes effect at once on a running server.
    pub fn add(&self, name: &str) -> Result<PathBuf, AccessError> {
        use std::os::unix::fs::DirBuilderExt;
        Users::valid(name)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|e| Users::file_err(&self.dir, e))?;
        let path = self.token_file(name);
        if path.exists() {
            return Err(AccessError::Exists {
                name: name.to_string(),
                path,
            });
        }
        let token = Token::generate().map_err(|e| Users::file_err(&path, e))?;
        // Written beside and renamed, so a running server never reads half a token.
        let part = self.dir.join(format!(".{name}{SUFFIX}.part"));
        token.write(&part).map_err(|e| Users::file_err(&part, e))?;
        std::fs::rename(&part, &path).map_err(|e| Users::file_err(&path, e))?;
        Ok(path)
    }

    /// Removes user `name`: their token stops working at once; their jobs stay (the admin sees
    /// them).
    pub fn remove(&self, name: &str) -> Result<(), AccessError> {
        Users::valid(name)?;
        let path = self.token_file(name);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(AccessError::NoUser {
                name: name.to_string(),
                dir: self.dir.clone(),
            }),
            Err(e) => Err(Users::file_err(&path, e)),
        }
    }

    /// The users' names, sorted.
    pub fn names(&self) -> Result<Vec<String>, AccessError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Users::file_err(&self.dir, e)),
        };
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| Users::file_err(&self.dir, e))?;
            let file = entry.file_name();
            let Some(name) = file.to_str().and_then(|f| f.strip_suffix(SUFFIX)) else {
                continue;
            };
            if Users::valid(name).is_ok() {
                names.push(name.to_string());
            }
        }
        names.sort();
        Ok(names)
    }

    /// The user whose token is `given`, if any. Read from the folder on every call, so users
    /// added or removed while a server runs count at once; an unreadable token file is logged
    /// and skipped (it locks out only its user).
    fn find(&self, given: &str) -> Result<Option<String>, AccessError> {
        for name in self.names()? {
            let path = self.token_file(&name);
            match Token::read(&path) {
                Ok(token) if token.matches(given) => return Ok(Some(name)),
                Ok(_) => {}
                Err(e) => tracing::warn!(user = %name, "skipping an unusable token file: {e}"),
            }
        }
        Ok(None)
    }
}

/// The job API's interceptor: lets a call through with its [`Caller`] in the request's
/// extensions, or refuses it with UNAUTHENTICATED (no token, or one the server does not know).
/// What a caller may do is the API's to check ([`Caller::check`], [`Caller::owner`]).
#[derive(Clone)]
pub struct ApiGuard {
    admin: Token,
    agent: Token,
    users: Users,
    /// Whether a call without a token may pass as the admin while there are no users.
    loopback: bool,
}

impl ApiGuard {
    /// A guard for a server with these tokens; `loopback`: its listener only takes calls from
    /// this host.
    pub fn new(admin: Token, agent: Token, users: Users, loopback: bool) -> ApiGuard {
        ApiGuard {
            admin,
            agent,
            users,
            loopback,
        }
    }

    /// Who presents `given` (or no token).
    pub fn caller(&self, given: Option<&str>) -> Result<Caller, Status> {
        let internal = |e: AccessError| Status::internal(e.to_string());
        let Some(given) = given else {
            if !self.loopback {
                return Err(Status::unauthenticated(
                    "missing token (authorization: Bearer …): this server is not on loopback",
                ));
            }
            if self.users.names().map_err(internal)?.is_empty() {
                return Ok(Caller::Admin);
            }
            return Err(Status::unauthenticated(
                "missing token (authorization: Bearer …): this server has users, so every call presents a token (--token-file)",
            ));
        };
        if self.admin.matches(given) {
            return Ok(Caller::Admin);
        }
        if self.agent.matches(given) {
            return Ok(Caller::Agent);
        }
        match self.users.find(given).map_err(internal)? {
            Some(name) => Ok(Caller::User(name)),
            None => Err(Status::unauthenticated(
                "wrong token: neither the server's admin token nor a user's",
            )),
        }
    }
}

impl tonic::service::Interceptor for ApiGuard {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let caller = self.caller(actors::presented(&request))?;
        request.extensions_mut().insert(caller);
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orchestrator::store::{JobState, Progress};

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("trellis-access-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn job(owner: Option<&str>) -> Job {
        Job {
            id: 3,
            name: "j".into(),
            spec: serde_json::json!({}),
            state: JobState::Pending,
            error: None,
            created_ms: 0,
            updated_ms: 0,
            progress: Progress::default(),
            owner: owner.map(str::to_string),
        }
    }

    #[test]
    fn each_token_is_its_caller_and_only_that() {
        let dir = scratch("guard");
        let users = Users::at(&dir);
        let (admin, agent) = (Token::generate().unwrap(), Token::generate().unwrap());
        let stranger = Token::generate().unwrap();
        let secret = |t: &Token| {
            use tonic::service::Interceptor;
            let r = t.bearer().call(Request::new(())).unwrap();
            actors::presented(&r).unwrap().to_string()
        };
        let loopback = ApiGuard::new(admin.clone(), agent.clone(), users.clone(), true);
        let open = ApiGuard::new(admin.clone(), agent.clone(), users.clone(), false);
        // No users yet: loopback lets a call without a token in as the admin.
        assert_eq!(
            loopback.caller(None).map_err(|s| s.code()),
            Ok(Caller::Admin)
        );
        assert_eq!(
            open.caller(None).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        let alice = Token::read(&users.add("alice").unwrap()).unwrap();
        let bob = Token::read(&users.add("bob").unwrap()).unwrap();
        type Want = Result<Caller, tonic::Code>;
        let table: [(&str, Option<String>, Want, Want); 6] = [
            (
                "admin",
                Some(secret(&admin)),
                Ok(Caller::Admin),
                Ok(Caller::Admin),
            ),
            (
                "alice",
                Some(secret(&alice)),
                Ok(Caller::User("alice".into())),
                Ok(Caller::User("alice".into())),
            ),
            (
                "bob",
                Some(secret(&bob)),
                Ok(Caller::User("bob".into())),
                Ok(Caller::User("bob".into())),
            ),
            (
                "agent",
                Some(secret(&agent)),
                Ok(Caller::Agent),
                Ok(Caller::Agent),
            ),
            (
                "stranger",
                Some(secret(&stranger)),
                Err(tonic::Code::Unauthenticated),
                Err(tonic::Code::Unauthenticated),
            ),
            // With users, loopback no longer lets a call without a token in.
            (
                "none",
                None,
                Err(tonic::Code::Unauthenticated),
                Err(tonic::Code::Unauthenticated),
            ),
        ];
        for (what, given, on_loopback, off_loopback) in table {
            for (guard, want) in [(&loopback, on_loopback), (&open, off_loopback)] {
                let got = guard.caller(given.as_deref()).map_err(|s| s.code());
                assert_eq!(got, want, "{what}, loopback {}", guard.loopback);
            }
        }
        // Removed: the token stops working at once.
        users.remove("bob").unwrap();
        assert_eq!(
            loopback.caller(Some(&secret(&bob))).map_err(|s| s.code()),
            Err(tonic::Code::Unauthenticated)
        );
        assert_eq!(users.names().unwrap(), vec!["alice".to_string()]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn users_see_their_own_jobs_and_the_admin_sees_all() {
        let alice = Caller::User("alice".into());
        let table = [
            (Caller::Admin, None, true),
            (Caller::Admin, Some("alice"), true),
            (alice.clone(), Some("alice"), true),
            (alice.clone(), Some("bob"), false),
            (alice.clone(), None, false),
            (Caller::Agent, None, false),
            (Caller::Agent, Some("alice"), false),
        ];
        for (caller, owner, may) in table {
            assert_eq!(caller.may_use(owner), may, "{caller:?} on {owner:?}");
            assert_eq!(caller.check(&job(owner)).is_ok(), may);
        }
        let e = alice.check(&job(Some("bob"))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("job 3 is not yours"),
            "{}",
            e.message()
        );
        let e = Caller::Agent.owner().unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("agents' token cannot submit"),
            "{}",
            e.message()
        );
    }

    #[test]
    fn user_files_are_private_and_names_are_checked() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("files");
        let users = Users::at(&dir);
        let path = users.add("carol-2.x").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&path), mode(users.dir())), (0o600, 0o700));
        assert!(matches!(
            users.add("carol-2.x"),
            Err(AccessError::Exists { .. })
        ));
        for bad in ["", "admin", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(
                matches!(users.add(bad), Err(AccessError::Name(_))),
                "{bad:?}"
            );
        }
        let e = users.remove("dave").unwrap_err().to_string();
        assert!(e.contains("no user dave"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
