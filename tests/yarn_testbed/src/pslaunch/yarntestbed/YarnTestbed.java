package pslaunch.yarntestbed;

import java.io.ByteArrayInputStream;
import java.io.DataInputStream;
import java.io.DataOutputStream;
import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.lang.reflect.Proxy;
import java.net.InetSocketAddress;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermissions;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.EnumSet;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import javax.crypto.SecretKey;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.FileUtil;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.io.Text;
import org.apache.hadoop.ipc.Server;
import org.apache.hadoop.security.Credentials;
import org.apache.hadoop.security.SecurityUtil;
import org.apache.hadoop.security.UserGroupInformation;
import org.apache.hadoop.security.token.SecretManager;
import org.apache.hadoop.security.token.Token;
import org.apache.hadoop.security.token.TokenIdentifier;
import org.apache.hadoop.util.RunJar;
import org.apache.hadoop.yarn.api.ApplicationClientProtocol;
import org.apache.hadoop.yarn.api.ApplicationMasterProtocol;
import org.apache.hadoop.yarn.api.ContainerManagementProtocol;
import org.apache.hadoop.yarn.api.protocolrecords.AllocateRequest;
import org.apache.hadoop.yarn.api.protocolrecords.AllocateResponse;
import org.apache.hadoop.yarn.api.protocolrecords.FinishApplicationMasterRequest;
import org.apache.hadoop.yarn.api.protocolrecords.FinishApplicationMasterResponse;
import org.apache.hadoop.yarn.api.protocolrecords.GetApplicationReportRequest;
import org.apache.hadoop.yarn.api.protocolrecords.GetApplicationReportResponse;
import org.apache.hadoop.yarn.api.protocolrecords.GetApplicationsRequest;
import org.apache.hadoop.yarn.api.protocolrecords.GetApplicationsResponse;
import org.apache.hadoop.yarn.api.protocolrecords.GetContainerStatusesRequest;
import org.apache.hadoop.yarn.api.protocolrecords.GetContainerStatusesResponse;
import org.apache.hadoop.yarn.api.protocolrecords.GetNewApplicationRequest;
import org.apache.hadoop.yarn.api.protocolrecords.GetNewApplicationResponse;
import org.apache.hadoop.yarn.api.protocolrecords.KillApplicationRequest;
import org.apache.hadoop.yarn.api.protocolrecords.KillApplicationResponse;
import org.apache.hadoop.yarn.api.protocolrecords.RegisterApplicationMasterRequest;
import org.apache.hadoop.yarn.api.protocolrecords.RegisterApplicationMasterResponse;
import org.apache.hadoop.yarn.api.protocolrecords.StartContainerRequest;
import org.apache.hadoop.yarn.api.protocolrecords.StartContainersRequest;
import org.apache.hadoop.yarn.api.protocolrecords.StartContainersResponse;
import org.apache.hadoop.yarn.api.protocolrecords.StopContainersRequest;
import org.apache.hadoop.yarn.api.protocolrecords.StopContainersResponse;
import org.apache.hadoop.yarn.api.protocolrecords.SubmitApplicationRequest;
import org.apache.hadoop.yarn.api.protocolrecords.SubmitApplicationResponse;
import org.apache.hadoop.yarn.api.records.ApplicationAttemptId;
import org.apache.hadoop.yarn.api.records.ApplicationId;
import org.apache.hadoop.yarn.api.records.ApplicationReport;
import org.apache.hadoop.yarn.api.records.ApplicationResourceUsageReport;
import org.apache.hadoop.yarn.api.records.ApplicationSubmissionContext;
import org.apache.hadoop.yarn.api.records.Container;
import org.apache.hadoop.yarn.api.records.ContainerExitStatus;
import org.apache.hadoop.yarn.api.records.ContainerId;
import org.apache.hadoop.yarn.api.records.ContainerLaunchContext;
import org.apache.hadoop.yarn.api.records.ContainerState;
import org.apache.hadoop.yarn.api.records.ContainerStatus;
import org.apache.hadoop.yarn.api.records.FinalApplicationStatus;
import org.apache.hadoop.yarn.api.records.LocalResource;
import org.apache.hadoop.yarn.api.records.LocalResourceType;
import org.apache.hadoop.yarn.api.records.NMToken;
import org.apache.hadoop.yarn.api.records.NodeId;
import org.apache.hadoop.yarn.api.records.Priority;
import org.apache.hadoop.yarn.api.records.Resource;
import org.apache.hadoop.yarn.api.records.ResourceRequest;
import org.apache.hadoop.yarn.api.records.SerializedException;
import org.apache.hadoop.yarn.api.records.YarnApplicationState;
import org.apache.hadoop.yarn.conf.YarnConfiguration;
import org.apache.hadoop.yarn.exceptions.ApplicationNotFoundException;
import org.apache.hadoop.yarn.exceptions.YarnException;
import org.apache.hadoop.yarn.ipc.YarnRPC;
import org.apache.hadoop.yarn.proto.YarnServiceProtos.SchedulerResourceTypes;
import org.apache.hadoop.yarn.security.AMRMTokenIdentifier;
import org.apache.hadoop.yarn.security.ContainerTokenIdentifier;
import org.apache.hadoop.yarn.security.NMTokenIdentifier;
import org.apache.hadoop.yarn.util.Records;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * A one-node YARN for tests: a ResourceManager and a NodeManager in one process, serving
 * the three protocols a YARN application uses, over Hadoop's own RPC and records.
 *
 * <ul>
 * <li>client -> ResourceManager ({@code ApplicationClientProtocol}, yarn.resourcemanager.address):
 *     new application, submit, report, list, kill;</li>
 * <li>application master -> ResourceManager ({@code ApplicationMasterProtocol},
 *     yarn.resourcemanager.scheduler.address): register, allocate, finish. As in YARN the
 *     master is known by the AMRMToken it authenticates with (SASL DIGEST-MD5, even with
 *     security off), written into its container's token file;</li>
 * <li>application master -> NodeManager ({@code ContainerManagementProtocol},
 *     yarn.nodemanager.address): start, stop, status. The container id comes from the
 *     container token, whose signature is checked.</li>
 * </ul>
 *
 * <p>Scheduling is trivial: every container request is granted at the next heartbeat, on the one
 * node, whatever the resources (no queues beyond the configured names, no limits). A container
 * runs as YARN's DefaultContainerExecutor runs it: its resources are localized through the Hadoop
 * FileSystem into its directory (archives unpacked), {@code launch_container.sh} exports the
 * environment as {@code export NAME="VALUE"} and execs the command under {@code setsid}, so the
 * container is one process group; a stop sends SIGTERM to the group and SIGKILL after
 * yarn.nodemanager.sleep-delay-before-sigkill.ms. Exit statuses and the application's states
 * follow YARN: after the master unregisters the application is FINISHED with the final status it
 * gave (and its other containers are killed); if the master exits first it is FAILED; a kill makes
 * it KILLED.
 */
public final class YarnTestbed {
  private static final Logger LOG = LoggerFactory.getLogger(YarnTestbed.class);
  private static final long AM_EXIT_GRACE_MS = 10_000;  // after unregistering, before it is killed

  private final Configuration conf = new YarnConfiguration();
  private final long clusterTimestamp = System.currentTimeMillis();
  private final Tokens amrmTokens = new Tokens();
  private final Map<ApplicationId, App> apps = new LinkedHashMap<>();
  private final Map<ContainerId, Ctr> containers = new HashMap<>();
  private final ExecutorService launcher = Executors.newCachedThreadPool();
  private final ScheduledExecutorService timer = Executors.newSingleThreadScheduledExecutor();
  private final String user = System.getProperty("user.name");
  private final Resource maxResource = Resource.newInstance(
      conf.getInt(YarnConfiguration.NM_PMEM_MB, YarnConfiguration.DEFAULT_NM_PMEM_MB),
      conf.getInt(YarnConfiguration.NM_VCORES, YarnConfiguration.DEFAULT_NM_VCORES));
  private final long sigkillDelayMs = conf.getLong(YarnConfiguration.NM_SLEEP_DELAY_BEFORE_SIGKILL_MS,
      YarnConfiguration.DEFAULT_NM_SLEEP_DELAY_BEFORE_SIGKILL_MS);
  private final File localDir = new File(conf.get(YarnConfiguration.NM_LOCAL_DIRS));
  private final File logDir = new File(conf.get(YarnConfiguration.NM_LOG_DIRS));
  private final List<String> queues = Arrays.asList(
      conf.getStrings("yarn.scheduler.capacity.root.queues", "default"));
  private NodeId nodeId;
  private String nodeHttpAddress;
  private InetSocketAddress schedulerAddress;
  private int lastAppNumber;

  /** One application, as the ResourceManager keeps it. */
  private static final class App {
    final ApplicationId id;
    final ApplicationAttemptId attempt;  // one attempt: the testbed never restarts a master
    final ApplicationSubmissionContext context;
    final String user;
    final long submitTime = System.currentTimeMillis();
    final List<Ctr> containers = new ArrayList<>();
    final List<ContainerStatus> toReport = new ArrayList<>();  // completed, not yet told to the AM
    YarnApplicationState state = YarnApplicationState.ACCEPTED;
    FinalApplicationStatus finalStatus = FinalApplicationStatus.UNDEFINED;
    String diagnostics = "";
    String amHost = "N/A";
    int amRpcPort = -1;
    String trackingUrl = "";
    float progress;
    long launchTime;
    long finishTime;

    App(ApplicationId id, ApplicationSubmissionContext context, String user) {
      this.id = id;
      this.attempt = ApplicationAttemptId.newInstance(id, 1);
      this.context = context;
      this.user = user;
    }

    boolean ended() {
      return state == YarnApplicationState.FINISHED || state == YarnApplicationState.FAILED
          || state == YarnApplicationState.KILLED;
    }
  }

  /** One container: allocated, then started (a process group), then complete. */
  private static final class Ctr {
    final App app;
    final ContainerId id;
    final Resource resource;
    final boolean master;
    boolean startRequested;
    Process process;
    int killedAs;      // the ContainerExitStatus a stop is reported with; 0 while not stopped
    String killReason;
    ContainerStatus completed;

    Ctr(App app, ContainerId id, Resource resource, boolean master) {
      this.app = app;
      this.id = id;
      this.resource = resource;
      this.master = master;
    }
  }

  /** Signs AMRM and container tokens with one key, as the RM's secret managers do. */
  private static final class Tokens extends SecretManager<AMRMTokenIdentifier> {
    private final SecretKey key = generateSecret();

    @Override
    protected byte[] createPassword(AMRMTokenIdentifier id) {
      return sign(id.getBytes());
    }

    @Override
    public byte[] retrievePassword(AMRMTokenIdentifier id) {
      return sign(id.getBytes());
    }

    @Override
    public AMRMTokenIdentifier createIdentifier() {
      return new AMRMTokenIdentifier();
    }

    byte[] sign(byte[] identifier) {
      return createPassword(identifier, key);
    }
  }

  public static void main(String[] args) throws Exception {
    new YarnTestbed().run();
  }

  private void run() throws IOException, InterruptedException {
    Server nm = serve(ContainerManagementProtocol.class, YarnConfiguration.NM_ADDRESS,
        YarnConfiguration.DEFAULT_NM_ADDRESS, YarnConfiguration.DEFAULT_NM_PORT, null);
    String nmHost = conf.getSocketAddr(YarnConfiguration.NM_ADDRESS, YarnConfiguration.DEFAULT_NM_ADDRESS,
        YarnConfiguration.DEFAULT_NM_PORT).getHostString();
    nodeId = NodeId.newInstance(nmHost, nm.getListenerAddress().getPort());
    // Nothing serves HTTP here: the address only names the node, as YARN's reports do.
    nodeHttpAddress = nmHost + ":" + conf.getSocketAddr(YarnConfiguration.NM_WEBAPP_ADDRESS,
        YarnConfiguration.DEFAULT_NM_WEBAPP_ADDRESS, YarnConfiguration.DEFAULT_NM_WEBAPP_PORT).getPort();
    Server scheduler = serve(ApplicationMasterProtocol.class, YarnConfiguration.RM_SCHEDULER_ADDRESS,
        YarnConfiguration.DEFAULT_RM_SCHEDULER_ADDRESS, YarnConfiguration.DEFAULT_RM_SCHEDULER_PORT, amrmTokens);
    schedulerAddress = scheduler.getListenerAddress();
    Server rm = serve(ApplicationClientProtocol.class, YarnConfiguration.RM_ADDRESS,
        YarnConfiguration.DEFAULT_RM_ADDRESS, YarnConfiguration.DEFAULT_RM_PORT, null);
    Runtime.getRuntime().addShutdownHook(new Thread(this::killEverything, "kill-containers"));
    LOG.info("YARN testbed up: ResourceManager {}, scheduler {}, NodeManager {} (cluster timestamp {})",
        rm.getListenerAddress(), schedulerAddress, nodeId, clusterTimestamp);
    rm.join();  // the RPC servers' threads are daemons
  }

  /** An RPC server for {@code protocol}, answered by this object's public method of the same name. */
  private Server serve(Class<?> protocol, String key, String defaultAddress, int defaultPort,
      SecretManager<? extends TokenIdentifier> secrets) {
    Object impl = Proxy.newProxyInstance(protocol.getClassLoader(), new Class<?>[] {protocol},
        (proxy, method, args) -> {
          Method handler;
          try {
            handler = YarnTestbed.class.getMethod(method.getName(), method.getParameterTypes());
          } catch (NoSuchMethodException e) {
            throw new YarnException(protocol.getSimpleName() + "." + method.getName()
                + " is not implemented by the YARN testbed");
          }
          try {
            return handler.invoke(this, args);
          } catch (InvocationTargetException e) {
            throw e.getCause();
          }
        });
    InetSocketAddress address = conf.getSocketAddr(key, defaultAddress, defaultPort);
    Server server = YarnRPC.create(conf).getServer(protocol, impl, address, conf, secrets, 4);
    server.start();
    return server;
  }

  // --- ApplicationClientProtocol (the client -> ResourceManager) ------------------------------

  public synchronized GetNewApplicationResponse getNewApplication(GetNewApplicationRequest request) {
    ApplicationId id = ApplicationId.newInstance(clusterTimestamp, ++lastAppNumber);
    return GetNewApplicationResponse.newInstance(id, Resource.newInstance(1, 1), maxResource);
  }

  public synchronized SubmitApplicationResponse submitApplication(SubmitApplicationRequest request)
      throws IOException {
    ApplicationSubmissionContext context = request.getApplicationSubmissionContext();
    App app = new App(context.getApplicationId(), context,
        UserGroupInformation.getCurrentUser().getShortUserName());
    apps.put(app.id, app);
    LOG.info("{} submitted by {}: {} ({}) to queue {}", app.id, app.user, context.getApplicationName(),
        context.getApplicationType(), context.getQueue());
    if (!queues.contains(context.getQueue())) {  // what the CapacityScheduler does
      end(app, YarnApplicationState.FAILED, FinalApplicationStatus.FAILED, "Application " + app.id
          + " submitted by user " + app.user + " to unknown queue: " + context.getQueue());
      return SubmitApplicationResponse.newInstance();
    }
    // The master's container: number 1 of attempt 1, with an AMRMToken in its token file.
    Ctr master = newContainer(app, context.getResource(), true);
    Token<AMRMTokenIdentifier> amrm = new Token<>(new AMRMTokenIdentifier(app.attempt, 1), amrmTokens);
    amrm.setService(SecurityUtil.buildTokenService(schedulerAddress));
    Map<String, String> env = new LinkedHashMap<>();
    env.put("APPLICATION_WEB_PROXY_BASE", "/proxy/" + app.id);
    env.put("APP_SUBMIT_TIME_ENV", Long.toString(app.submitTime));
    env.put("MAX_APP_ATTEMPTS", "1");
    master.startRequested = true;
    startContainer(master, context.getAMContainerSpec(), amrm, env);
    return SubmitApplicationResponse.newInstance();
  }

  public synchronized GetApplicationReportResponse getApplicationReport(GetApplicationReportRequest request)
      throws YarnException {
    return GetApplicationReportResponse.newInstance(report(app(request.getApplicationId())));
  }

  public synchronized GetApplicationsResponse getApplications(GetApplicationsRequest request) {
    List<ApplicationReport> reports = new ArrayList<>();
    EnumSet<YarnApplicationState> states = request.getApplicationStates();
    for (App app : apps.values()) {
      if (states == null || states.isEmpty() || states.contains(app.state)) {
        reports.add(report(app));
      }
    }
    return GetApplicationsResponse.newInstance(reports);
  }

  /** Kills every container of the application; complete once their processes are gone. */
  public synchronized KillApplicationResponse forceKillApplication(KillApplicationRequest request)
      throws YarnException {
    App app = app(request.getApplicationId());
    if (!app.ended()) {
      end(app, YarnApplicationState.KILLED, FinalApplicationStatus.KILLED, "Application " + app.id
          + " was killed by user " + currentUser() + " at " + Server.getRemoteAddress());
    }
    boolean gone = app.containers.stream().allMatch(c -> c.completed != null);
    return KillApplicationResponse.newInstance(gone);
  }

  // --- ApplicationMasterProtocol (the application master -> ResourceManager) -------------------

  public RegisterApplicationMasterResponse registerApplicationMaster(RegisterApplicationMasterRequest request)
      throws YarnException {
    synchronized (this) {
      App app = caller();
      app.amHost = request.getHost();
      app.amRpcPort = request.getRpcPort();
      app.trackingUrl = request.getTrackingUrl() == null ? "" : request.getTrackingUrl();
      if (app.state == YarnApplicationState.ACCEPTED) {
        app.state = YarnApplicationState.RUNNING;
        app.launchTime = System.currentTimeMillis();
      }
      LOG.info("{}: master registered at {}:{}", app.id, app.amHost, app.amRpcPort);
      RegisterApplicationMasterResponse response = Records.newRecord(RegisterApplicationMasterResponse.class);
      response.setMaximumResourceCapability(maxResource);
      response.setApplicationACLs(Collections.emptyMap());
      response.setQueue(app.context.getQueue());
      response.setSchedulerResourceTypes(EnumSet.of(SchedulerResourceTypes.MEMORY, SchedulerResourceTypes.CPU));
      return response;
    }
  }

  /**
   * Releases what the master releases, grants every container it asks for at once (the ask's
   * off-switch {@code *} entry carries the whole count on one node), reports completed containers.
   */
  public AllocateResponse allocate(AllocateRequest request) throws YarnException {
    synchronized (this) {
      App app = caller();
      app.progress = request.getProgress();
      for (ContainerId id : request.getReleaseList()) {
        Ctr c = containers.get(id);
        if (c != null && c.app == app) {
          stop(c, ContainerExitStatus.ABORTED, "Container released by application");
        }
      }
      List<Container> granted = new ArrayList<>();
      for (ResourceRequest ask : request.getAskList()) {
        if (!ResourceRequest.ANY.equals(ask.getResourceName()) || app.ended()) {
          continue;
        }
        for (int i = 0; i < ask.getNumContainers(); i++) {
          Ctr c = newContainer(app, ask.getCapability(), false);
          Container container = Container.newInstance(c.id, nodeId, nodeHttpAddress, c.resource,
              ask.getPriority(), containerToken(c, ask.getPriority()));
          container.setAllocationRequestId(ask.getAllocationRequestId());
          granted.add(container);
        }
      }
      AllocateResponse response = Records.newRecord(AllocateResponse.class);
      response.setResponseId(request.getResponseId() + 1);
      response.setAllocatedContainers(granted);
      response.setCompletedContainersStatuses(new ArrayList<>(app.toReport));
      app.toReport.clear();
      response.setAvailableResources(maxResource);
      response.setNumClusterNodes(1);
      if (!granted.isEmpty()) {
        NMTokenIdentifier id = new NMTokenIdentifier(app.attempt, nodeId, app.user, 1);
        response.setNMTokens(Collections.singletonList(NMToken.newInstance(nodeId,
            yarnToken(id.getBytes(), NMTokenIdentifier.KIND, nodeId.toString()))));
      }
      return response;
    }
  }

  public FinishApplicationMasterResponse finishApplicationMaster(FinishApplicationMasterRequest request)
      throws YarnException {
    synchronized (this) {
      App app = caller();
      if (!app.ended()) {
        app.trackingUrl = request.getTrackingUrl() == null ? app.trackingUrl : request.getTrackingUrl();
        String diagnostics = request.getDiagnostics() == null ? "" : request.getDiagnostics();
        end(app, YarnApplicationState.FINISHED, request.getFinalApplicationStatus(), diagnostics);
      }
      return FinishApplicationMasterResponse.newInstance(true);
    }
  }

  // --- ContainerManagementProtocol (the application master -> NodeManager) -----------------------

  public StartContainersResponse startContainers(StartContainersRequest request) throws IOException, YarnException {
    List<ContainerId> started = new ArrayList<>();
    Map<ContainerId, SerializedException> failed = new HashMap<>();
    for (StartContainerRequest start : request.getStartContainerRequests()) {
      ContainerId id = verify(start.getContainerToken()).getContainerID();
      synchronized (this) {
        Ctr c = containers.get(id);
        if (c == null || c.startRequested) {
          failed.put(id, SerializedException.newInstance(
              new YarnException("Container " + id + " is unknown or was started already")));
          continue;
        }
        c.startRequested = true;
        startContainer(c, start.getContainerLaunchContext(), null, Collections.emptyMap());
        started.add(id);
      }
    }
    return StartContainersResponse.newInstance(Collections.emptyMap(), started, failed);
  }

  public synchronized StopContainersResponse stopContainers(StopContainersRequest request) {
    List<ContainerId> stopped = new ArrayList<>();
    for (ContainerId id : request.getContainerIds()) {
      Ctr c = containers.get(id);
      if (c != null) {
        stop(c, ContainerExitStatus.KILLED_BY_APPMASTER, "Container killed by the ApplicationMaster.");
        stopped.add(id);
      }
    }
    return StopContainersResponse.newInstance(stopped, Collections.emptyMap());
  }

  public synchronized GetContainerStatusesResponse getContainerStatuses(GetContainerStatusesRequest request) {
    List<ContainerStatus> statuses = new ArrayList<>();
    for (ContainerId id : request.getContainerIds()) {
      Ctr c = containers.get(id);
      if (c != null) {
        statuses.add(c.completed != null ? c.completed : ContainerStatus.newInstance(c.id,
            c.process != null ? ContainerState.RUNNING : ContainerState.NEW, "", ContainerExitStatus.INVALID));
      }
    }
    return GetContainerStatusesResponse.newInstance(statuses, Collections.emptyMap());
  }

  // --- the ResourceManager's bookkeeping -------------------------------------------------------

  private App app(ApplicationId id) throws ApplicationNotFoundException {
    App app = apps.get(id);
    if (app == null) {
      throw new ApplicationNotFoundException("Application with id '" + id + "' doesn't exist in RM.");
    }
    return app;
  }

  /** The application whose master calls: named by the AMRMToken its connection authenticated with. */
  private App caller() throws YarnException {
    try {
      for (TokenIdentifier id : UserGroupInformation.getCurrentUser().getTokenIdentifiers()) {
        if (id instanceof AMRMTokenIdentifier) {
          return app(((AMRMTokenIdentifier) id).getApplicationAttemptId().getApplicationId());
        }
      }
    } catch (IOException e) {
      throw new YarnException(e);
    }
    throw new YarnException("only an application master may call this: no AMRMToken on the connection");
  }

  private static String currentUser() {
    try {
      return UserGroupInformation.getCurrentUser().getShortUserName();
    } catch (IOException e) {
      return "?";
    }
  }

  private ApplicationReport report(App app) {
    Resource used = Resource.newInstance(0, 0);
    int running = 0;
    for (Ctr c : app.containers) {
      if (c.process != null && c.completed == null) {
        used = Resource.newInstance(used.getMemorySize() + c.resource.getMemorySize(),
            used.getVirtualCores() + c.resource.getVirtualCores());
        running++;
      }
    }
    ApplicationResourceUsageReport usage = Records.newRecord(ApplicationResourceUsageReport.class);
    usage.setNumUsedContainers(running);
    usage.setUsedResources(used);
    usage.setReservedResources(Resource.newInstance(0, 0));
    usage.setNeededResources(used);
    ApplicationReport r = Records.newRecord(ApplicationReport.class);
    r.setApplicationId(app.id);
    r.setCurrentApplicationAttemptId(app.attempt);
    r.setUser(app.user);
    r.setQueue(app.context.getQueue());
    r.setName(app.context.getApplicationName());
    r.setApplicationType(app.context.getApplicationType());
    r.setApplicationTags(app.context.getApplicationTags());
    r.setHost(app.amHost);
    r.setRpcPort(app.amRpcPort);
    r.setTrackingUrl(app.trackingUrl);
    r.setOriginalTrackingUrl(app.trackingUrl);
    r.setYarnApplicationState(app.state);
    r.setFinalApplicationStatus(app.finalStatus);
    r.setDiagnostics(app.diagnostics);
    r.setProgress(app.progress);
    r.setSubmitTime(app.submitTime);
    r.setStartTime(app.submitTime);
    r.setLaunchTime(app.launchTime);
    r.setFinishTime(app.finishTime);
    r.setApplicationResourceUsageReport(usage);
    return r;
  }

  /** The application's end: its state, and its containers killed (the master after a grace). */
  private void end(App app, YarnApplicationState state, FinalApplicationStatus status, String diagnostics) {
    app.state = state;
    app.finalStatus = status;
    app.diagnostics = diagnostics;
    app.finishTime = System.currentTimeMillis();
    LOG.info("{}: {} / {}: {}", app.id, state, status, diagnostics);
    cleanUp(app);
    for (Ctr c : app.containers) {
      if (c.master && state == YarnApplicationState.FINISHED) {
        timer.schedule(() -> {
          synchronized (this) {
            stop(c, ContainerExitStatus.KILLED_AFTER_APP_COMPLETION, "Container killed after the application finished.");
          }
        }, AM_EXIT_GRACE_MS, TimeUnit.MILLISECONDS);
      } else if (state == YarnApplicationState.KILLED) {
        stop(c, ContainerExitStatus.KILLED_BY_RESOURCEMANAGER, "Container killed by the ResourceManager.");
      } else {
        stop(c, ContainerExitStatus.KILLED_AFTER_APP_COMPLETION, "Container killed after the application finished.");
      }
    }
  }

  private Ctr newContainer(App app, Resource resource, boolean master) {
    Ctr c = new Ctr(app, ContainerId.newContainerId(app.attempt, app.containers.size() + 1), resource, master);
    app.containers.add(c);
    containers.put(c.id, c);
    return c;
  }

  private org.apache.hadoop.yarn.api.records.Token containerToken(Ctr c, Priority priority) {
    ContainerTokenIdentifier id = new ContainerTokenIdentifier(c.id, nodeId.toString(), c.app.user, c.resource,
        System.currentTimeMillis() + 600_000, 1, clusterTimestamp, priority, System.currentTimeMillis());
    return yarnToken(id.getBytes(), ContainerTokenIdentifier.KIND, nodeId.toString());
  }

  private org.apache.hadoop.yarn.api.records.Token yarnToken(byte[] identifier, Text kind, String service) {
    return org.apache.hadoop.yarn.api.records.Token.newInstance(identifier, kind.toString(),
        amrmTokens.sign(identifier), service);
  }

  private ContainerTokenIdentifier verify(org.apache.hadoop.yarn.api.records.Token token)
      throws IOException, YarnException {
    if (token == null) {
      throw new YarnException("no container token: a container must be allocated by the ResourceManager");
    }
    byte[] identifier = bytes(token.getIdentifier());
    if (!Arrays.equals(bytes(token.getPassword()), amrmTokens.sign(identifier))) {
      throw new YarnException("invalid container token (not signed by this ResourceManager)");
    }
    ContainerTokenIdentifier id = new ContainerTokenIdentifier();
    id.readFields(new DataInputStream(new ByteArrayInputStream(identifier)));
    return id;
  }

  private static byte[] bytes(ByteBuffer buffer) {
    ByteBuffer b = buffer.duplicate();
    byte[] out = new byte[b.remaining()];
    b.get(out);
    return out;
  }

  // --- the NodeManager: containers as process groups -----------------------------------------------

  /** Localizes and starts the container on the launcher pool; it completes with a failure if that fails. */
  private void startContainer(Ctr c, ContainerLaunchContext context, Token<?> extraToken,
      Map<String, String> extraEnv) {
    launcher.execute(() -> {
      try {
        ProcessBuilder builder = prepare(c, context, extraToken, extraEnv);
        synchronized (this) {
          if (c.killedAs != 0) {  // stopped while its files were localized
            complete(c, c.killedAs, c.killReason);
            return;
          }
          c.process = builder.start();
        }
        LOG.info("{}: started, process group {}", c.id, c.process.pid());
        c.process.onExit().thenAccept(p -> exited(c, p.exitValue()));
      } catch (Exception e) {
        LOG.warn("{}: failed to start", c.id, e);
        synchronized (this) {
          complete(c, ContainerExitStatus.INVALID, "Container failed to start: " + e);
        }
      }
    });
  }

  /** The container's directory with its resources, token file and scripts, as DefaultContainerExecutor lays it out. */
  private ProcessBuilder prepare(Ctr c, ContainerLaunchContext context, Token<?> extraToken,
      Map<String, String> extraEnv) throws Exception {
    String appId = c.app.id.toString();
    File appDir = new File(localDir, "usercache/" + c.app.user + "/appcache/" + appId);
    File dir = new File(appDir, c.id.toString());
    File logs = new File(logDir, appId + "/" + c.id);
    if (!dir.mkdirs() || !(logs.isDirectory() || logs.mkdirs())) {
      throw new IOException("cannot create " + dir + " and " + logs);
    }
    for (Map.Entry<String, LocalResource> e : context.getLocalResources().entrySet()) {
      localize(e.getValue(), new File(dir, e.getKey()));
    }
    Credentials credentials = new Credentials();
    if (context.getTokens() != null) {
      credentials.readTokenStorageStream(new DataInputStream(new ByteArrayInputStream(bytes(context.getTokens()))));
    }
    if (extraToken != null) {
      credentials.addToken(extraToken.getService(), extraToken);
    }
    File tokenFile = new File(dir, "container_tokens");
    try (DataOutputStream out = new DataOutputStream(new FileOutputStream(tokenFile))) {
      credentials.writeTokenStorageToStream(out);
    }

    Map<String, String> env = new LinkedHashMap<>(context.getEnvironment());
    env.putAll(extraEnv);
    for (String name : new String[] {"JAVA_HOME", "HADOOP_COMMON_HOME", "HADOOP_HDFS_HOME", "HADOOP_CONF_DIR",
        "CLASSPATH_PREPEND_DISTCACHE", "HADOOP_YARN_HOME"}) {  // yarn.nodemanager.env-whitelist
      if (!env.containsKey(name) && System.getenv(name) != null) {
        env.put(name, System.getenv(name));
      }
    }
    env.put("CONTAINER_ID", c.id.toString());
    env.put("NM_HOST", nodeId.getHost());
    env.put("NM_PORT", Integer.toString(nodeId.getPort()));
    env.put("NM_HTTP_PORT", nodeHttpAddress.substring(nodeHttpAddress.lastIndexOf(':') + 1));
    env.put("LOCAL_DIRS", appDir.getPath());
    env.put("LOCAL_USER_DIRS", new File(localDir, "usercache/" + c.app.user).getPath());
    env.put("LOG_DIRS", logs.getPath());
    env.put("USER", c.app.user);
    env.put("LOGNAME", c.app.user);
    env.put("HOME", conf.get(YarnConfiguration.NM_USER_HOME_DIR, YarnConfiguration.DEFAULT_NM_USER_HOME_DIR));
    env.put("PWD", dir.getPath());
    env.put("HADOOP_TOKEN_FILE_LOCATION", tokenFile.getPath());

    StringBuilder script = new StringBuilder("#!/bin/bash\n\nset -o pipefail -e\n");
    script.append("export PRELAUNCH_OUT=\"").append(logs).append("/prelaunch.out\"\nexec >\"${PRELAUNCH_OUT}\"\n");
    script.append("export PRELAUNCH_ERR=\"").append(logs).append("/prelaunch.err\"\nexec 2>\"${PRELAUNCH_ERR}\"\n");
    script.append("echo \"Setting up env variables\"\n");
    for (Map.Entry<String, String> e : env.entrySet()) {  // unescaped, exactly as YARN writes them
      script.append("export ").append(e.getKey()).append("=\"").append(expand(e.getValue(), logs)).append("\"\n");
    }
    script.append("echo \"Launching container\"\n");
    List<String> command = new ArrayList<>();
    for (String part : context.getCommands()) {
      command.add(expand(part, logs));
    }
    script.append("exec /bin/bash -c \"").append(String.join(" ", command)).append("\"\n");
    File launch = write(new File(dir, "launch_container.sh"), script.toString());
    // The session script records the pid (= the process group: setsid does not fork here) and
    // execs the launch script, as default_container_executor_session.sh does.
    File pidFile = new File(dir, "container.pid");
    File session = write(new File(dir, "default_container_executor_session.sh"), "#!/bin/bash\n\necho $$ > "
        + pidFile + ".tmp\n/bin/mv -f " + pidFile + ".tmp " + pidFile + "\nexec setsid /bin/bash \"" + launch + "\"\n");
    return new ProcessBuilder("/bin/bash", session.getPath()).directory(dir)
        .redirectErrorStream(true).redirectOutput(ProcessBuilder.Redirect.appendTo(new File(logs, "launcher.log")));
  }

  /** {{VAR}} -> $VAR, <CPS> -> ':', <LOG_DIR> -> the container's log directory (ContainerLaunch.expandEnvironment). */
  private static String expand(String value, File logs) {
    return value.replace("<LOG_DIR>", logs.getPath()).replace("<CPS>", File.pathSeparator)
        .replace("{{", "$").replace("}}", "");
  }

  private static File write(File file, String text) throws IOException {
    Files.write(file.toPath(), text.getBytes(StandardCharsets.UTF_8));
    return file;
  }

  /** Copies a resource through the Hadoop FileSystem, checking its timestamp as FSDownload does; unpacks archives. */
  private void localize(LocalResource resource, File target) throws Exception {
    Path source = resource.getResource().toPath();
    FileSystem fs = source.getFileSystem(conf);
    FileStatus status = fs.getFileStatus(source);
    if (status.getModificationTime() != resource.getTimestamp()) {
      throw new IOException("Resource " + source + " changed on src filesystem - expected: \""
          + resource.getTimestamp() + "\", was: \"" + status.getModificationTime() + "\"");
    }
    if (resource.getType() != LocalResourceType.ARCHIVE) {
      fs.copyToLocalFile(false, source, new Path(target.getAbsolutePath()), true);
      Files.setPosixFilePermissions(target.toPath(), PosixFilePermissions.fromString("r-x------"));
      return;
    }
    File download = new File(target.getParentFile(), ".download-" + source.getName());
    fs.copyToLocalFile(false, source, new Path(download.getAbsolutePath()), true);
    String name = source.getName().toLowerCase();
    if (name.endsWith(".jar")) {
      RunJar.unJar(download, target, RunJar.MATCH_ANY);
    } else if (name.endsWith(".zip")) {
      FileUtil.unZip(download, target);
    } else if (name.endsWith(".tar.gz") || name.endsWith(".tgz") || name.endsWith(".tar")) {
      FileUtil.unTar(download, target);
    } else {
      LOG.warn("cannot unpack {}: kept as a file", source);
      Files.move(download.toPath(), target.toPath());
    }
    Files.deleteIfExists(download.toPath());
  }

  /** Stops a container: SIGTERM to its process group, SIGKILL after the configured delay. */
  private void stop(Ctr c, int exitStatus, String reason) {
    if (c.completed != null || c.killedAs != 0) {
      return;
    }
    c.killedAs = exitStatus;
    c.killReason = reason;
    if (c.process == null) {
      if (!c.startRequested) {  // allocated, never started
        complete(c, exitStatus, reason);
      }  // else: being localized; startContainer completes it
      return;
    }
    signal(c, "TERM");
    timer.schedule(() -> signal(c, "KILL"), sigkillDelayMs, TimeUnit.MILLISECONDS);
  }

  private void signal(Ctr c, String signal) {
    try {
      new ProcessBuilder("kill", "-" + signal, "--", "-" + c.process.pid())
          .redirectErrorStream(true).redirectOutput(ProcessBuilder.Redirect.DISCARD).start().waitFor();
    } catch (IOException e) {
      LOG.warn("{}: kill -{} failed: {}", c.id, signal, e.getMessage());
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
  }

  private synchronized void exited(Ctr c, int code) {
    String diagnostics;
    int exitStatus;
    if (c.killedAs != 0) {
      exitStatus = c.killedAs;
      diagnostics = c.killReason + "\nContainer killed on request. Exit code is " + code + "\n";
    } else {
      exitStatus = code;
      diagnostics = code == 0 ? "" : "Exception from container-launch.\nContainer id: " + c.id + "\nExit code: "
          + code + "\nContainer exited with a non-zero exit code " + code + ". \n";
    }
    complete(c, exitStatus, diagnostics);
  }

  private void complete(Ctr c, int exitStatus, String diagnostics) {
    if (c.completed != null) {
      return;
    }
    c.completed = ContainerStatus.newInstance(c.id, ContainerState.COMPLETE, diagnostics, exitStatus);
    LOG.info("{}: complete, exit status {}", c.id, exitStatus);
    cleanUp(c.app);
    if (!c.master) {
      c.app.toReport.add(c.completed);
    } else if (!c.app.ended()) {
      end(c.app, YarnApplicationState.FAILED, FinalApplicationStatus.FAILED, "AM Container for " + c.app.attempt
          + " exited with  exitCode: " + exitStatus + "\n" + diagnostics + "Failing this attempt. Failing the application.");
    }
  }

  /**
   * Once the application has ended and its containers are gone, its containers' directories are
   * deleted (yarn.nodemanager.delete.debug-delay-sec later, default at once); logs stay.
   */
  private void cleanUp(App app) {
    if (app.ended() && app.containers.stream().allMatch(c -> c.completed != null)) {
      File dir = new File(localDir, "usercache/" + app.user + "/appcache/" + app.id);
      timer.schedule(() -> FileUtil.fullyDelete(dir),
          conf.getInt(YarnConfiguration.DEBUG_NM_DELETE_DELAY_SEC, 0), TimeUnit.SECONDS);
    }
  }

  /** At shutdown: no container outlives the testbed. */
  private void killEverything() {
    synchronized (this) {
      for (Ctr c : containers.values()) {
        if (c.process != null && c.completed == null) {
          signal(c, "KILL");
        }
      }
    }
  }
}
